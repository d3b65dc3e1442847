"""kube-scheduler refusing the node the controller chose, for a reason the controller does not
evaluate (inter-pod affinity, topology spread, volumes, ports: driver/scheduling/nodefit.py says what it does).

kube-scheduler, finding a released pod unfit for the node of its claim's allocation, deallocates
the claim in its PostFilter (it clears `status.allocation`; only a claim reserved for no pod but
this one). The controller notices: a claim whose allocation it wrote, whose pods it released, has
no allocation any more. It remembers the node as refused for those pods (for as long as they
exist, while this replica runs), places the claim again without it (a gang member with the rest of
its gang kept), counts the refusal in `fgpu_controller_replaced_by_scheduler_total{reason}` and
says it in an Event on the claim and the pods, in kube-scheduler's words once its pod status has
them. kube-scheduler may allocate the claim first (the pod is no longer gated): that allocation is
then its own, and counted as any other."""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Iterable, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Any

from driver.controller import metrics
from driver.controller.api import ControllerApi
from driver.controller.fit import allocated_node, live_pods
from driver.controller.reporter import Reporter
from driver.kube.errors import KubeError
from driver.kube.informer import Informer, object_key
from driver.scheduling.opt_in import gated, known_claim_names, opted_in

log = logging.getLogger(__name__)
JsonObject = dict[str, Any]
REPORT_WITHIN_S = 10.0  # how long a refusal waits for kube-scheduler's words before it is reported without
ASK_AFTER_S = 1.0  # its Event is recorded asynchronously: read only after this, once a pass
EVENT_REASON = "NodeRefusedByScheduler"
# Label of the metric -> what kube-scheduler's FitError message says for it (its plugins' reasons).
REASONS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("inter-pod-affinity", ("pod affinity rules", "pod anti-affinity rules", "existing pods anti-affinity")),
    ("topology-spread", ("topology spread constraints",)),
    ("volume", ("volume", "persistentvolumeclaim")),
    ("ports", ("free ports",)),
    ("node-fit", ("insufficient", "untolerated taint", "node affinity/selector", "unschedulable", "too many pods")),
)


@dataclass(frozen=True)
class Refusal:
    """A claim the controller placed on `node` that kube-scheduler gave back."""

    claim: str  # namespace/name
    uid: str
    node: str
    pods: tuple[str, ...]  # namespace/name of the pods it refused the node for
    noticed: float  # time.monotonic()


def refusal_reason(message: str) -> str:
    """The metric's label for kube-scheduler's message: the first of REASONS it mentions."""
    lowered = message.lower()
    for label, phrases in REASONS:
        if any(phrase in lowered for phrase in phrases):
            return label
    return "other"


def pods_by_claim(pods: Iterable[JsonObject]) -> dict[str, list[JsonObject]]:
    """Claim key -> the live pods that use it (by name, or through their status for a template's)."""
    out: dict[str, list[JsonObject]] = defaultdict(list)
    for pod in live_pods(pods):
        for name in known_claim_names(pod):
            out[f"{pod['metadata']['namespace']}/{name}"].append(pod)
    return out


def released(pods: list[JsonObject]) -> bool:
    """Whether the controller has let the pods go: some exist and none waits at its gate."""
    return bool(pods) and not any(gated(pod) for pod in pods)


def given_back(
    placed: dict[str, str],
    claims: dict[str, JsonObject],
    pods_of: dict[str, list[JsonObject]],
    now: float,
) -> tuple[list[Refusal], list[str]]:
    """The claims (by uid in `placed`, the node the controller allocated them on) that
    kube-scheduler gave back (no allocation now, or one on another node), and the uids not worth
    remembering any more: the claim is gone, or every pod of it is bound to a node (nothing can
    give it back then)."""
    refusals, done = [], []
    for uid, node in list(placed.items()):
        claim = claims.get(uid)
        if claim is None:
            done.append(uid)
            continue
        pods = pods_of.get(object_key(claim), [])
        allocated_on = allocated_node(claim)
        if allocated_on == node:
            if pods and all((p.get("spec") or {}).get("nodeName") for p in pods):
                done.append(uid)
            continue
        # No allocation, or kube-scheduler's own on another node (it may re-allocate before a
        # pass sees the claim without one).
        if opted_in(claim) and released(pods) and not claim["metadata"].get("deletionTimestamp"):
            refusals.append(Refusal(object_key(claim), uid, node, tuple(object_key(p) for p in pods), now))
            done.append(uid)
    return refusals, done


def scheduler_says(pod: JsonObject | None) -> str | None:
    """kube-scheduler's message on the pod for its last failed attempt, if its status still says
    it (the pod may be bound by the time a pass looks: its Event says it then)."""
    for condition in (pod or {}).get("status", {}).get("conditions") or ():
        if condition.get("type") == "PodScheduled" and condition.get("reason") == "Unschedulable":
            return str(condition.get("message") or "")
    return None


class RefusalTracker:
    """Remembers the allocations this replica wrote (`placed`, told by writes.py), notices those
    kube-scheduler gave back, rules the refused nodes out for those pods (`refused`, read by the
    pass's node room) and tells each refusal once."""

    def __init__(self, api: ControllerApi, informers: dict[str, Informer], reporter: Reporter) -> None:
        self._api, self._informers, self._reporter = api, informers, reporter
        self._placed: dict[str, str] = {}  # claim uid -> the node of the allocation this replica wrote
        self._refused: dict[str, set[str]] = {}  # pod key -> nodes kube-scheduler refused for it
        self._unreported: dict[str, Refusal] = {}  # claim uid -> refusal waiting for kube-scheduler's words

    @property
    def refused(self) -> Mapping[str, AbstractSet[str]]:
        """Pod key -> nodes kube-scheduler refused for it."""
        return self._refused

    def placed(self, uid: str, node: str) -> None:
        """The allocation of claim `uid` on `node` was written by this replica: watched from now on."""
        self._placed[uid] = node

    def notice(self) -> None:
        """Called at the start of a pass, before anything is placed: the refused nodes are then
        ruled out for the pods the pass places claims for."""
        if self._placed:
            claims = {c["metadata"].get("uid", ""): c for c in self._informers["claims"].items()}
            pods_of = pods_by_claim(self._informers["pods"].items())
            refusals, done = given_back(self._placed, claims, pods_of, time.monotonic())
            for uid in done:
                del self._placed[uid]
            for refusal in refusals:
                log.info("kube-scheduler gave back claim %s: node %s refused", refusal.claim, refusal.node)
                for pod in refusal.pods:
                    self._refused.setdefault(pod, set()).add(refusal.node)
                self._unreported[refusal.uid] = refusal
        if self._refused:
            live = {object_key(p) for p in self._informers["pods"].items()}
            for pod in self._refused.keys() - live:
                del self._refused[pod]
        self._report_refusals()

    def _report_refusals(self) -> None:
        """Each refusal counted and told once, with kube-scheduler's message once its pod status has
        it (it writes the claim first, the pod's condition after), or without it after a while."""
        for uid, refusal in list(self._unreported.items()):
            pods = [self._informers["pods"].get(key) for key in refusal.pods]
            said = [m for pod in pods if (m := scheduler_says(pod)) is not None]
            waited = time.monotonic() - refusal.noticed
            if not said and waited >= ASK_AFTER_S:
                said = self._failed_scheduling(refusal.pods)
            if not said and waited < REPORT_WITHIN_S:
                continue
            del self._unreported[uid]
            message = said[0] if said else "kube-scheduler did not say why"
            metrics.REPLACED_BY_SCHEDULER.labels(refusal_reason(message)).inc()
            claim_name = refusal.claim.split("/", 1)[1]
            what = (
                f"kube-scheduler refused node {refusal.node} for the pod ({message}) and gave back claim "
                f"{claim_name}; fgpu places it again without that node"
            )
            claim = self._informers["claims"].get(refusal.claim)
            if claim is not None and claim["metadata"].get("uid") == uid:
                self._reporter.event("resource.k8s.io/v1", "ResourceClaim", claim, EVENT_REASON, what, True)
            for pod in pods:
                if pod is not None:
                    self._reporter.event("v1", "Pod", pod, EVENT_REASON, what, True)

    def _failed_scheduling(self, pods: tuple[str, ...]) -> list[str]:
        """kube-scheduler's newest FailedScheduling message on any of the pods ([] if none yet)."""
        for key in pods:
            namespace, name = key.split("/", 1)
            try:
                if messages := self._api.scheduling_failures(namespace, name):
                    return messages[:1]
            except KubeError as error:
                log.warning("cannot read the events of pod %s: %s", key, error)
        return []
