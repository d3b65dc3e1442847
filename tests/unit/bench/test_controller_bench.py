"""bench/controller.py's reading of the pods without a cluster: when fgpu released each pod, when
a phase counts as settled, and what it says of the pods left unbound (those fgpu still gates apart
from those kube-scheduler has)."""

from __future__ import annotations

import json
import threading
import time
from types import SimpleNamespace
from typing import Any

import bench.controller
from bench.controller import Observed, settled, unbound_summary
from driver.scheduling.opt_in import SCHEDULING_GATE


def _pod(name: str, gated: bool, node: str = "", message: str = "") -> dict[str, Any]:
    conditions = [{"type": "PodScheduled", "status": "False", "message": message}] if message else []
    spec: dict[str, Any] = {"schedulingGates": [{"name": SCHEDULING_GATE}] if gated else []}
    if node:
        spec["nodeName"] = node
    return {"metadata": {"name": name}, "spec": spec, "status": {"conditions": conditions}}


class _Core:
    def __init__(self, pods: list[dict[str, Any]]) -> None:
        self._data = json.dumps({"items": pods}).encode()

    def list_namespaced_pod(self, namespace: str, _preload_content: bool) -> SimpleNamespace:
        return SimpleNamespace(data=self._data)


def test_a_pod_counts_as_released_once_seen_without_fgpus_gate_and_bound_once_it_has_a_node():
    observed = Observed()
    observed.on_pod(_pod("a", gated=True))
    assert "a" not in observed.pod_released and "a" not in observed.pod_bound
    observed.on_pod(_pod("a", gated=False))
    released = observed.pod_released["a"]
    observed.on_pod(_pod("a", gated=False, node="n1"))
    assert observed.pod_released["a"] == released <= observed.pod_bound["a"]


def test_the_unbound_pods_are_told_apart_by_who_holds_them():
    stale = "0/4 nodes are available: scheduling gates"
    pods = [
        _pod("bound", gated=False, node="n1"),
        _pod("gated", gated=True, message=stale),
        _pod("released-1", gated=False, message=stale),
        _pod("released-2", gated=False, message=stale),
        _pod("released-3", gated=False, message="cannot allocate all claims"),
    ]
    summary = unbound_summary(_Core(pods), "ns")  # type: ignore[arg-type]
    assert summary.startswith("4 pods: 1 gated by fgpu, 3 released")
    assert f"2: {stale}; 1: cannot allocate all claims" in summary
    assert unbound_summary(_Core([_pod("gated", gated=True)]), "ns") == "1 pods: 1 gated by fgpu, 0 released"  # type: ignore[arg-type]


def test_on_the_controllers_path_a_released_pod_is_waited_for_and_one_still_gated_is_not(monkeypatch):
    monkeypatch.setattr(bench.controller, "SETTLED_S", 0.1)
    observed = Observed()
    observed.on_pod(_pod("bound", gated=False, node="n1"))
    observed.on_pod(_pod("held", gated=True))  # the controller could not place it: left
    observed.on_pod(_pod("released", gated=False))
    settled(observed, 3, gated=False)  # kube-scheduler's path: nothing bound for a while, settled
    assert "released" not in observed.pod_bound
    binding = threading.Timer(0.5, observed.on_pod, [_pod("released", gated=False, node="n2")])
    started = time.monotonic()  # before the timer starts: it binds 0.5 s after this at the earliest
    binding.start()
    settled(observed, 3, gated=True)
    assert "released" in observed.pod_bound and "held" not in observed.pod_bound
    assert time.monotonic() - started >= 0.5
