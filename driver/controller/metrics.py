"""What the controller did, for Prometheus."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

ALLOCATIONS = Counter("fgpu_controller_allocations_total", "Claims the controller tried to allocate", ["result"])
GANGS = Counter("fgpu_controller_gangs_total", "Gangs the controller tried to place", ["result"])
CONFLICTS = Counter("fgpu_controller_conflicts_total", "Status writes refused because the claim had changed")
GATES_LIFTED = Counter("fgpu_controller_gates_lifted_total", "Pods whose scheduling gate was lifted")
GATES_LIFTED_EARLY = Counter(
    "fgpu_controller_gates_lifted_early_total",
    "Gates lifted before the claim watch delivered the allocation (kube-scheduler may retry the pod)",
)
MARKED_UNSCHEDULABLE = Counter(
    "fgpu_controller_pods_marked_unschedulable_total",
    "Gated pods whose claims fit nowhere, marked PodScheduled=False/Unschedulable for node autoscalers",
)
ALLOCATION_SECONDS = Histogram(
    "fgpu_controller_allocation_seconds",
    "Time to find an allocation for one claim",
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0),
)
LEADER = Gauge("fgpu_controller_leader", "1 while this replica holds the lease")
PENDING = Gauge("fgpu_controller_pending_claims", "Opt-in claims waiting for an allocation")
REFRESHES = Counter("fgpu_controller_refreshes_total", "Claims and ledgers read afresh after a failed write")
CACHE_SYNC_SECONDS = Gauge(
    "fgpu_controller_cache_sync_seconds", "Seconds from start until every cache was listed (slices parsed)"
)
REPLACED_BY_SCHEDULER = Counter(
    "fgpu_controller_replaced_by_scheduler_total",
    "Claims kube-scheduler gave back after refusing the node the controller chose, by its reason",
    ["reason"],
)
EVICTIONS = Counter(
    "fgpu_controller_evictions_total",
    "Pods evicted to make room for a claim (movable, preemption), to empty GPUs (compaction) or nodes (emptying),"
    " and evictions a PodDisruptionBudget refused",
    ["reason"],
)
