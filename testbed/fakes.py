"""An in-memory KubeApi for unit tests and the in-memory benchmarks: same methods and JSON shapes as
driver.kube.client.ClientKubeApi. A stand-in for the API server where a test or benchmark is about the
node alone; integration and end-to-end tests use the real control plane (testbed/cluster)."""

from __future__ import annotations

import copy
import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

from driver.kube.client import JsonObject
from driver.kube.errors import ConflictError, KubeError, KubeUnavailableError, NotFoundError, RefusedError

DeviceKey = tuple[str, str, str, str]


class InMemoryKubeApi:
    def __init__(self) -> None:
        self.claims: dict[tuple[str, str], JsonObject] = {}
        self.nodes: dict[str, JsonObject] = {}
        self.pods: dict[tuple[str, str], JsonObject] = {}
        self.configmaps: dict[tuple[str, str], JsonObject] = {}
        self.slices: dict[str, JsonObject] = {}
        self.unavailable = False
        self.claim_gets = 0
        # Server-side apply on claims' status.devices: which manager owns which entries.
        self.status_owners: dict[tuple[str, str], dict[str, set[DeviceKey]]] = {}
        self.status_refusal = ""  # set: status writes are refused with this reason (as RBAC would)
        self.status_refusal_code = 403
        self.status_conflicts = 0  # this many status writes lose a race (another writer got in first)
        self.status_writes = 0  # status writes that reached the claim
        self.events: list[JsonObject] = []
        self._version = 0
        self._lock = threading.Lock()
        self._watchers: list[queue.Queue[tuple[str, JsonObject]]] = []

    def _check(self) -> None:
        if self.unavailable:
            raise KubeUnavailableError("connection refused")

    def _bump(self, obj: JsonObject) -> JsonObject:
        self._version += 1
        obj.setdefault("metadata", {})["resourceVersion"] = str(self._version)
        return obj

    def _notify(self, event: str, obj: JsonObject) -> None:
        for watcher in list(self._watchers):
            watcher.put((event, copy.deepcopy(obj)))

    # KubeApi
    def close(self) -> None:
        for watcher in list(self._watchers):
            watcher.put(("CLOSED", {"spec": {}}))

    def get_claim(self, namespace: str, name: str) -> JsonObject:
        self._check()
        self.claim_gets += 1
        try:
            return copy.deepcopy(self.claims[(namespace, name)])
        except KeyError:
            raise NotFoundError(f"{namespace}/{name}") from None

    def apply_claim_status(self, namespace: str, name: str, body: JsonObject, field_manager: str) -> JsonObject:
        """The apiserver's apply of status.devices (a map list keyed by driver, pool, device and
        shareID): the manager's entries become those in `body`; entries it no longer names go
        unless another manager owns them. Validated as ResourceClaimStatus updates are."""
        self._check()
        if self.status_refusal:
            raise KubeError(f"API server refused the request: 403 {self.status_refusal}")
        with self._lock:
            claim = self.claims.get((namespace, name))
            if claim is None:
                raise NotFoundError(f"{namespace}/{name}")
            uid = body["metadata"].get("uid")
            if uid and uid != claim["metadata"]["uid"]:
                raise KubeError(f"API server refused the request: 422 metadata.uid {uid}: field is immutable")
            entries = {_device_key(e): copy.deepcopy(e) for e in (body.get("status") or {}).get("devices") or []}
            _validate_device_status(claim, list(entries.values()))
            owners = self.status_owners.setdefault((namespace, name), {})
            others = set().union(*(keys for manager, keys in owners.items() if manager != field_manager))
            dropped = owners.get(field_manager, set()) - set(entries) - others
            status = claim.setdefault("status", {})
            kept = [e for e in status.get("devices") or [] if _device_key(e) not in dropped | set(entries)]
            status["devices"] = kept + list(entries.values())
            if not status["devices"]:
                del status["devices"]
            owners[field_manager] = set(entries)
            return copy.deepcopy(self._bump(claim))

    def write_claim_device_status(
        self,
        namespace: str,
        name: str,
        uid: str,
        replaced: Callable[[DeviceKey], bool],
        entries: list[JsonObject],
        field_manager: str,
    ) -> None:
        """The status PUT of ClientKubeApi: the entries for which `replaced` holds become
        `entries`, the rest stays; a claim re-created under the name counts as gone."""
        self._check()
        with self._lock:
            claim = self.claims.get((namespace, name))
            if claim is None or claim["metadata"]["uid"] != uid:
                raise NotFoundError(f"{namespace}/{name}")
            version = claim["metadata"].get("resourceVersion", "")
            if self.status_conflicts:
                self.status_conflicts -= 1
                self._bump(claim)  # the other writer's change
                raise ConflictError("conflict: the object has been modified")
            if self.status_refusal:
                message = f"API server refused the request: {self.status_refusal_code} {self.status_refusal}"
                raise RefusedError(message, self.status_refusal_code, version)
            try:
                _validate_device_status(claim, entries)
            except KubeError as err:
                raise RefusedError(str(err), 422, version) from None
            status = claim.setdefault("status", {})
            kept = [e for e in status.get("devices") or [] if not replaced(_device_key(e))]
            status["devices"] = kept + copy.deepcopy(entries)
            if not status["devices"]:
                del status["devices"]
            self.status_owners.setdefault((namespace, name), {})[field_manager] = {_device_key(e) for e in entries}
            self.status_writes += 1
            self._bump(claim)

    def create_event(self, namespace: str, event: JsonObject) -> JsonObject:
        self._check()
        stored = {**copy.deepcopy(event), "metadata": {**event["metadata"], "namespace": namespace}}
        name = event["metadata"].get("name")
        with self._lock:
            if name and any(
                e["metadata"].get("name") == name and e["metadata"]["namespace"] == namespace for e in self.events
            ):
                raise ConflictError(f'conflict: events "{name}" already exists')  # the API server's 409
            self.events.append(stored)
        return stored

    def get_node(self, name: str) -> JsonObject:
        self._check()
        try:
            return copy.deepcopy(self.nodes[name])
        except KeyError:
            raise NotFoundError(name) from None

    def list_all_claims(self, from_cache: bool = False) -> list[JsonObject]:
        self._check()
        return [copy.deepcopy(claim) for claim in self.claims.values()]

    def annotate_pod(self, namespace: str, name: str, uid: str, annotations: dict[str, str]) -> None:
        self._check()
        with self._lock:
            pod = self.pods.get((namespace, name))
            if pod is None:
                raise NotFoundError(f"{namespace}/{name}")
            if pod["metadata"].get("uid") != uid:
                raise ConflictError(f"Precondition failed: UID in precondition: {uid}")
            pod["metadata"].setdefault("annotations", {}).update(annotations)
            self._bump(pod)

    def get_pod(self, namespace: str, name: str) -> JsonObject:
        self._check()
        try:
            return copy.deepcopy(self.pods[(namespace, name)])
        except KeyError:
            raise NotFoundError(f"{namespace}/{name}") from None

    def get_configmap(self, namespace: str, name: str) -> JsonObject:
        self._check()
        try:
            return copy.deepcopy(self.configmaps[(namespace, name)])
        except KeyError:
            raise NotFoundError(f"{namespace}/{name}") from None

    def create_configmap(self, namespace: str, body: JsonObject) -> JsonObject:
        self._check()
        with self._lock:
            key = (namespace, body["metadata"]["name"])
            if key in self.configmaps:
                raise ConflictError(f"configmaps {key[1]} already exists")
            self.configmaps[key] = self._bump(copy.deepcopy(body))
            return copy.deepcopy(self.configmaps[key])

    def replace_configmap(self, namespace: str, name: str, body: JsonObject) -> JsonObject:
        self._check()
        with self._lock:
            if (namespace, name) not in self.configmaps:
                raise NotFoundError(f"{namespace}/{name}")
            self.configmaps[(namespace, name)] = self._bump(copy.deepcopy(body))
            return copy.deepcopy(self.configmaps[(namespace, name)])

    def list_slices(self, driver: str, node: str) -> tuple[list[JsonObject], str]:
        self._check()
        with self._lock:
            items = [
                copy.deepcopy(s)
                for s in self.slices.values()
                if s["spec"]["driver"] == driver and s["spec"].get("nodeName") == node
            ]
            return items, str(self._version)

    def create_slice(self, body: JsonObject) -> JsonObject:
        self._check()
        with self._lock:
            name = body["metadata"]["name"]
            if name in self.slices:
                raise ValueError(f"slice {name} already exists")
            self.slices[name] = self._bump(copy.deepcopy(body))
            self._notify("ADDED", self.slices[name])
            return copy.deepcopy(self.slices[name])

    def replace_slice(self, name: str, body: JsonObject) -> JsonObject:
        self._check()
        with self._lock:
            current = self.slices.get(name)
            if current is None:
                raise NotFoundError(name)
            if body["metadata"].get("resourceVersion") != current["metadata"]["resourceVersion"]:
                raise ValueError("conflict")
            self.slices[name] = self._bump(copy.deepcopy(body))
            self._notify("MODIFIED", self.slices[name])
            return copy.deepcopy(self.slices[name])

    def delete_slice(self, name: str) -> None:
        self._check()
        with self._lock:
            removed = self.slices.pop(name, None)
            if removed is not None:
                self._notify("DELETED", removed)

    def watch_slices(
        self, driver: str, node: str, resource_version: str, timeout_s: int
    ) -> Iterator[tuple[str, JsonObject]]:
        self._check()
        events: queue.Queue[tuple[str, JsonObject]] = queue.Queue()
        self._watchers.append(events)
        try:
            while True:
                try:
                    event, obj = events.get(timeout=timeout_s)
                except queue.Empty:
                    return
                if event == "CLOSED":
                    raise KubeUnavailableError("connection closed")
                if obj["spec"]["driver"] == driver and obj["spec"].get("nodeName") == node:
                    yield event, obj
        finally:
            self._watchers.remove(events)


def _device_key(entry: JsonObject) -> DeviceKey:
    return (entry["driver"], entry["pool"], entry["device"], entry.get("shareID") or "")


def _validate_device_status(claim: JsonObject, entries: list[JsonObject]) -> None:
    """What the apiserver checks of status.devices entries (validateDeviceStatus)."""
    results = ((claim.get("status") or {}).get("allocation") or {}).get("devices", {}).get("results") or []
    allocated = {_device_key(r) for r in results}
    for entry in entries:
        if _device_key(entry) not in allocated:
            raise KubeError(f"API server refused the request: 422 {_device_key(entry)}: must be an allocated device")
        for condition in entry.get("conditions") or []:
            missing = [f for f in ("type", "status", "reason", "lastTransitionTime") if not condition.get(f)]
            if missing or condition["status"] not in ("True", "False", "Unknown"):
                raise KubeError(f"API server refused the request: 422 invalid condition {condition}")
        if "data" in entry and not isinstance(entry["data"], dict):
            raise KubeError("API server refused the request: 422 data must be a valid JSON object")


def node_object(name: str, uid: str = "node-uid-1") -> JsonObject:
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "uid": uid}}


def allocated_claim(
    namespace: str,
    name: str,
    uid: str,
    results: list[dict[str, Any]],
    config: list[dict[str, Any]] | None = None,
) -> JsonObject:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"namespace": namespace, "name": name, "uid": uid},
        "spec": {"devices": {"requests": [{"name": r["request"].split("/")[0]} for r in results]}},
        "status": {"allocation": {"devices": {"results": results, "config": config or []}}},
    }


def result(device: str, request: str = "gpu", pool: str = "node-a", driver: str = "gpu.fgpu.dev") -> dict[str, Any]:
    return {"request": request, "driver": driver, "pool": pool, "device": device}


class CallContext:
    """What a servicer reads of grpc.ServicerContext: whether the caller still waits for the answer
    (False: kubelet cancelled the call, or closed its connection, meanwhile). Unit tests call the
    DRA servicer directly, without a socket."""

    def __init__(self, active: bool = True) -> None:
        self.active = active

    def is_active(self) -> bool:
        return self.active
