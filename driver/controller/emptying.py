"""Emptying nodes for the autoscaler (`--empty-nodes`, with --compact-when-idle; docs/autoscaling.md):
which nodes may be emptied, and the taint that keeps new pods off a node while it empties.

A node may be emptied when every live pod on it is a movable pod of a GPU claim (victims.py) or a
DaemonSet's (an autoscaler counts a node that runs only those as empty), and it is not being
emptied already. Before its pods are evicted the node gets the NoSchedule taint
`gpu.fgpu.dev/emptying` (its value: when, for people to read), so that their replacements, and
anything else, go elsewhere: kube-scheduler, Karpenter and the controller's own room for pods
(nodefit.py) all keep off an untolerated taint. The autoscaler then removes the empty node.

The taint is lifted when something waits that no node takes (the node may be what it needs: used
again rather than a new node added for it), and EMPTYING_S after it was first seen (no autoscaler
removed the node: it is an ordinary node again). Time is this process's monotonic clock from when
this replica tainted the node or first saw the taint (a taint left by an earlier leader, or before
a restart), so no wall clock, skewed or not, decides a lift."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from collections.abc import Set as AbstractSet
from typing import Any

from driver.controller.api import ControllerApi
from driver.controller.clock import WallClock, monotonic
from driver.controller.fit import live_pods
from driver.kube.errors import KubeError
from driver.kube.informer import Informer
from driver.scheduling.opt_in import daemonset_pod

log = logging.getLogger(__name__)
JsonObject = dict[str, Any]
EMPTYING_TAINT = "gpu.fgpu.dev/emptying"
EMPTYING_S = 300.0  # how long a node stays tainted when nothing removes it


def taints_of(node: JsonObject) -> list[JsonObject]:
    return list((node.get("spec") or {}).get("taints") or [])


def is_emptying(node: JsonObject) -> bool:
    return any(t.get("key") == EMPTYING_TAINT for t in taints_of(node))


class NodeEmptier:
    """Says which nodes may be emptied, taints a node before it is, and lifts the taints."""

    def __init__(
        self, api: ControllerApi, nodes: Informer, wall_clock: WallClock, clock: Callable[[], float] = monotonic
    ) -> None:
        self._api, self._nodes, self._wall_clock, self._clock = api, nodes, wall_clock, clock
        self._since: dict[str, float] = {}  # node -> when (clock) this replica tainted it or first saw it tainted

    def may_empty(self, pods: Iterable[JsonObject], movable: AbstractSet[str]) -> set[str]:
        """The nodes not being emptied where every live pod is in `movable` (pod uids) or a
        DaemonSet's."""
        kept: set[str] = set()
        found: set[str] = set()
        for pod in live_pods(pods):
            node = (pod.get("spec") or {}).get("nodeName")
            if not node:
                continue
            if pod["metadata"].get("uid") in movable:
                found.add(node)
            elif not daemonset_pod(pod):
                kept.add(node)
        emptying = {n["metadata"]["name"] for n in self._nodes.items() if is_emptying(n)}
        return found - kept - emptying

    def taint(self, name: str) -> bool:
        """Taint the node (as last read: a node changed meanwhile is left alone this pass)."""
        node = self._nodes.get(f"/{name}")  # a node's key: no namespace
        if node is None:
            return False
        taint = {"key": EMPTYING_TAINT, "value": str(int(self._wall_clock.now().timestamp())), "effect": "NoSchedule"}
        try:
            self._nodes.update(self._api.set_node_taints(node, [*taints_of(node), taint]))
        except KubeError as error:
            log.info("cannot taint node %s to empty it: %s", name, error)
            return False
        self._since[name] = self._clock()
        return True

    def lift(self, every: bool) -> int:
        """Lift the emptying taints that are EMPTYING_S old, or `every` one; how many were lifted."""
        now = self._clock()
        tainted = [n for n in self._nodes.items() if is_emptying(n)]
        self._since = {n["metadata"]["name"]: self._since.get(n["metadata"]["name"], now) for n in tainted}
        lifted = 0
        for node in tainted:
            name = node["metadata"]["name"]
            if not every and now - self._since[name] < EMPTYING_S:
                continue
            kept = [t for t in taints_of(node) if t.get("key") != EMPTYING_TAINT]
            try:
                self._nodes.update(self._api.set_node_taints(node, kept))
            except KubeError as error:
                log.info("cannot lift the emptying taint of node %s: %s", name, error)
                continue
            del self._since[name]
            lifted += 1
        return lifted
