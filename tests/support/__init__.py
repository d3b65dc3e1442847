"""Helpers shared by the tests (no test module imports another): the chart (chart.py), the
reference allocator, its scenarios and the differential check (reference.py, scenarios.py,
differential.py), the allocator on small inventories (allocation.py), a node's pool (pools.py),
a node's prepared state (node_state.py), the controller as a process (controller.py) and in-process on
an in-memory API server (controller_cluster.py), the CLI (cli.py), the node's driver in-process:
kubelet's DRA calls and metric samples (dra_calls.py), shares and their configs (shares.py), claims
whose status other drivers share (claim_status.py), claims prepared again (prepare_again.py);
opaque configs (configs.py), metrics scraped over HTTP (metrics.py), openb's pods (openb.py); Kueue
admitting the workload operators' kinds: its queues and what it made of a job (frameworks.py)."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
