"""An in-memory API server for the controller (driver.controller.api.ControllerApi), for its unit
tests: objects with resourceVersions, writes conditioned on them, failures a test chooses. The
integration and end-to-end tests run the controller against the real control plane (testbed/cluster)."""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Iterator
from typing import Any

from driver.kube.errors import ConflictError, KubeUnavailableError, NotFoundError
from driver.kube.informer import object_key


class InMemoryControllerApi:
    """The API server as far as the controller sees it (driver.controller.api.ControllerApi): objects
    with resourceVersions, writes conditioned on them (a stale one conflicts), status and main
    resource written apart. There is no watch: the tests relist the informers."""

    def __init__(self) -> None:
        self.version = 100
        self.store: dict[str, dict[str, dict[str, Any]]] = {
            kind: {}
            for kind in ("slices", "classes", "claims", "pods", "nodes", "ledgers", "leases", "podgroups", "configmaps")
        }
        self.events: list[dict[str, Any]] = []
        self.status_writes: list[str] = []  # claim names, in order
        self.failing_status_writes: set[int] = set()  # status writes (counted from 1) that meet an outage
        self.lost_replies: set[int] = set()  # status writes applied whose answer never comes (a timeout)
        self.lease_outage = False
        self.write_delay_s = 0.0
        self.ledger_writes = 0
        self.evicted: list[str] = []  # pod names, in order
        self.nominated: list[tuple[str, str]] = []  # (pod name, node), in order
        self.taint_writes = 0
        self.budgeted: set[str] = set()  # pods a PodDisruptionBudget protects: their eviction is refused
        self._lock = threading.Lock()
        self.in_flight = self.most_in_flight = 0

    # --- storage ---

    def put(self, kind: str, obj: dict[str, Any]) -> dict[str, Any]:
        """Create or overwrite, unconditionally (the test acting as another client)."""
        with self._lock:
            self.version += 1
            obj = copy.deepcopy(obj)
            obj["metadata"]["resourceVersion"] = str(self.version)
            obj["metadata"].setdefault("uid", f"uid-{obj['metadata']['name']}")
            self.store[kind][object_key(obj)] = obj
            return copy.deepcopy(obj)

    def get(self, kind: str, key: str) -> dict[str, Any]:
        if key not in self.store[kind]:
            raise NotFoundError(key)
        return copy.deepcopy(self.store[kind][key])

    def _replace(self, kind: str, obj: dict[str, Any], keep: str | None = None) -> dict[str, Any]:
        with self._lock:
            current = self.store[kind].get(object_key(obj))
            if current is None:
                raise NotFoundError(object_key(obj))
            if obj["metadata"].get("resourceVersion") != current["metadata"]["resourceVersion"]:
                raise ConflictError("the object has been modified")
        if keep == "status":  # an update of the main resource leaves the status alone, and vice versa
            obj = {**obj, "status": current.get("status")}
        elif keep == "metadata":
            obj = {**obj, "metadata": {**current["metadata"]}}
        return self.put(kind, obj)

    def list_pages(
        self, kind: str, label_selector: str = "", namespace: str = "", limit: int = 500
    ) -> Iterator[tuple[list[dict[str, Any]], str]]:
        """In pages of at most 2 objects, whatever the limit: every list in these tests is paged."""
        with self._lock:
            kept = [obj for obj in self.store[kind].values() if _selected(obj, label_selector)]
            items, version = copy.deepcopy(kept), str(self.version)
        for start in range(0, max(len(items), 1), 2):
            yield items[start : start + 2], version

    def watch(
        self, kind: str, resource_version: str, timeout_s: int, label_selector: str = "", namespace: str = ""
    ) -> Iterator[tuple[str, dict[str, Any]]]:
        return iter(())

    # --- the fleet publisher's writes (driver/fleet) ---

    def create_slice(self, body: dict[str, Any]) -> dict[str, Any]:
        if object_key(body) in self.store["slices"]:
            raise ConflictError(f"{object_key(body)} already exists")
        return self.put("slices", body)

    def replace_slice(self, name: str, body: dict[str, Any]) -> dict[str, Any]:
        return self._replace("slices", body)

    def delete_slice(self, name: str) -> None:
        with self._lock:
            self.store["slices"].pop(f"/{name}", None)

    # --- the controller's calls ---

    def get_claim(self, namespace: str, name: str) -> dict[str, Any]:
        return self.get("claims", f"{namespace}/{name}")

    def replace_claim(self, claim: dict[str, Any]) -> dict[str, Any]:
        return self._replace("claims", claim, keep="status")

    def replace_claim_status(self, claim: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
            self.status_writes.append(claim["metadata"]["name"])
            outage = len(self.status_writes) in self.failing_status_writes
            lost = len(self.status_writes) in self.lost_replies
        try:
            time.sleep(self.write_delay_s)  # lets concurrent writes overlap
            if outage:
                raise KubeUnavailableError("API server unreachable")
            written = self._replace("claims", claim, keep="metadata")
            if lost:
                raise KubeUnavailableError("timed out waiting for the answer")
            return written
        finally:
            with self._lock:
                self.in_flight -= 1

    def create_ledger(self, namespace: str, ledger: dict[str, Any]) -> dict[str, Any]:
        if object_key(ledger) in self.store["ledgers"]:
            raise ConflictError("already exists")
        return self.put("ledgers", ledger)

    def replace_ledger(self, namespace: str, ledger: dict[str, Any]) -> dict[str, Any]:
        self.ledger_writes += 1
        time.sleep(self.write_delay_s)
        return self._replace("ledgers", ledger)

    def delete_configmap(self, namespace: str, configmap: dict[str, Any]) -> None:
        """A ledger or a usage history, deleted as read (uid and resourceVersion preconditions)."""
        key = object_key(configmap)
        with self._lock:
            kind = next((k for k in ("ledgers", "configmaps") if key in self.store[k]), None)
            if kind is None:
                raise NotFoundError(key)
            current = self.store[kind][key]
            if any(current["metadata"][k] != configmap["metadata"][k] for k in ("uid", "resourceVersion")):
                raise ConflictError("Precondition failed: the object has been modified")
            del self.store[kind][key]

    def set_scheduling_gates(self, pod: dict[str, Any], gates: list[Any]) -> dict[str, Any]:
        return self._replace("pods", {**pod, "spec": {**pod["spec"], "schedulingGates": gates}})

    def set_pod_condition(self, pod: dict[str, Any], condition: dict[str, Any]) -> dict[str, Any]:
        """As the API server merges it: the condition of that type replaced, the others kept."""
        current = self.get("pods", object_key(pod))
        status = current.get("status") or {}
        others = [c for c in status.get("conditions") or [] if c.get("type") != condition["type"]]
        current["status"] = {**status, "conditions": [*others, condition]}
        return self.put("pods", current)

    def nominate_node(self, pod: dict[str, Any], node: str) -> dict[str, Any]:
        current = self.get("pods", object_key(pod))
        current["status"] = {**(current.get("status") or {}), "nominatedNodeName": node}
        self.nominated.append((pod["metadata"]["name"], node))
        return self.put("pods", current)

    def create_event(self, namespace: str, event: dict[str, Any]) -> dict[str, Any]:
        self.events.append(event)
        return event

    def scheduling_failures(self, namespace: str, pod: str) -> list[str]:
        return []  # no kube-scheduler here

    def evict_pod(self, namespace: str, name: str) -> str | None:
        if name in self.budgeted:
            return "Cannot evict pod as it would violate the pod's disruption budget."
        self.store["pods"].pop(f"{namespace}/{name}")
        self.evicted.append(name)
        return None

    def set_node_taints(self, node: dict[str, Any], taints: list[Any]) -> dict[str, Any]:
        self.taint_writes += 1
        return self._replace("nodes", {**node, "spec": {**(node.get("spec") or {}), "taints": taints}})

    def get_lease(self, namespace: str, name: str) -> dict[str, Any]:
        if self.lease_outage:
            raise KubeUnavailableError("API server unreachable")
        return self.get("leases", f"{namespace}/{name}")

    def create_lease(self, namespace: str, lease: dict[str, Any]) -> dict[str, Any]:
        if self.lease_outage:
            raise KubeUnavailableError("API server unreachable")
        if object_key(lease) in self.store["leases"]:
            raise ConflictError("already exists")
        return self.put("leases", lease)

    def replace_lease(self, namespace: str, lease: dict[str, Any]) -> dict[str, Any]:
        if self.lease_outage:
            raise KubeUnavailableError("API server unreachable")
        return self._replace("leases", lease)


def _selected(obj: dict[str, Any], label_selector: str) -> bool:
    """Whether the object's labels match a selector of `key` and `key=value` terms."""
    labels = obj["metadata"].get("labels") or {}
    for term in filter(None, label_selector.split(",")):
        key, _, value = term.partition("=")
        if key not in labels or (value and labels[key] != value):
            return False
    return True
