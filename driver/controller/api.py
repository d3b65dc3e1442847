"""The controller's API calls: what it asks of the API server (ControllerApi), and that over the
official client, JSON in and out (errors as in driver.kube.client). An in-memory server for tests
and benchmarks is testbed/controller_api.py."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

import kubernetes

from driver.kube.client import CORE_V1, ClientKubeApi
from driver.kube.errors import TooManyRequestsError

JsonObject = dict[str, Any]
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"


class ControllerApi(Protocol):
    """Every call the controller, its informers, its lease (leader.py) and its ledgers (ledger.py) make."""

    def list_pages(
        self, kind: str, label_selector: str = "", namespace: str = "", limit: int = 500
    ) -> Iterator[tuple[list[JsonObject], str]]: ...

    def watch(
        self, kind: str, resource_version: str, timeout_s: int, label_selector: str = "", namespace: str = ""
    ) -> Iterator[tuple[str, JsonObject]]: ...

    def get_claim(self, namespace: str, name: str) -> JsonObject: ...

    def replace_claim(self, claim: JsonObject) -> JsonObject: ...

    def replace_claim_status(self, claim: JsonObject) -> JsonObject: ...

    def set_scheduling_gates(self, pod: JsonObject, gates: list[JsonObject]) -> JsonObject: ...

    def place_pod(self, pod: JsonObject, affinity: JsonObject, gates: list[JsonObject]) -> JsonObject: ...

    def set_pod_condition(self, pod: JsonObject, condition: JsonObject) -> JsonObject: ...

    def nominate_node(self, pod: JsonObject, node: str) -> JsonObject: ...

    def create_event(self, namespace: str, event: JsonObject) -> JsonObject: ...

    def scheduling_failures(self, namespace: str, pod: str) -> list[str]: ...

    def evict_pod(self, namespace: str, name: str) -> str | None: ...

    def set_node_taints(self, node: JsonObject, taints: list[JsonObject]) -> JsonObject: ...

    def get_lease(self, namespace: str, name: str) -> JsonObject: ...

    def create_lease(self, namespace: str, lease: JsonObject) -> JsonObject: ...

    def replace_lease(self, namespace: str, lease: JsonObject) -> JsonObject: ...

    def create_ledger(self, namespace: str, ledger: JsonObject) -> JsonObject: ...

    def replace_ledger(self, namespace: str, ledger: JsonObject) -> JsonObject: ...

    def delete_configmap(self, namespace: str, configmap: JsonObject) -> None: ...


class ClientControllerApi(ClientKubeApi):
    """ControllerApi over the official client."""

    def __init__(self, kubeconfig: str | None, timeout_s: float = 10.0, connections: int = 64) -> None:
        # The writers (MAX_IN_FLIGHT) and the watches, each on a connection of its own.
        super().__init__(kubeconfig, timeout_s, connections)
        self._coordination = kubernetes.client.CoordinationV1Api(self._client)

    def replace_claim(self, claim: JsonObject) -> JsonObject:
        meta = claim["metadata"]
        return self._call(self._resource.replace_namespaced_resource_claim, meta["name"], meta["namespace"], claim)

    def replace_claim_status(self, claim: JsonObject) -> JsonObject:
        meta = claim["metadata"]
        return self._call(
            self._resource.replace_namespaced_resource_claim_status, meta["name"], meta["namespace"], claim
        )

    def set_scheduling_gates(self, pod: JsonObject, gates: list[JsonObject]) -> JsonObject:
        meta = pod["metadata"]
        patch = [
            {"op": "test", "path": "/metadata/resourceVersion", "value": meta["resourceVersion"]},
            {"op": "replace", "path": "/spec/schedulingGates", "value": gates},
        ]
        return self._call(self._core.patch_namespaced_pod, meta["name"], meta["namespace"], patch)

    def place_pod(self, pod: JsonObject, affinity: JsonObject, gates: list[JsonObject]) -> JsonObject:
        """Pin a gated pod to a node and release it, in one request: its new affinity (its node
        affinity narrowed, which kube-apiserver allows while the pod is gated) and its gates, both
        on the pod as read (its resourceVersion tested). placed_pods.py says why."""
        meta = pod["metadata"]
        patch = [
            {"op": "test", "path": "/metadata/resourceVersion", "value": meta["resourceVersion"]},
            {"op": "add", "path": "/spec/affinity", "value": affinity},  # add replaces a member that exists
            {"op": "replace", "path": "/spec/schedulingGates", "value": gates},
        ]
        return self._call(self._core.patch_namespaced_pod, meta["name"], meta["namespace"], patch)

    def set_pod_condition(self, pod: JsonObject, condition: JsonObject) -> JsonObject:
        """Set one condition in the pod's status, by type (a strategic merge patch: the others stay)."""
        return self._patch_pod_status(pod, {"conditions": [condition]})

    def nominate_node(self, pod: JsonObject, node: str) -> JsonObject:
        """Set the pod's `status.nominatedNodeName` (kube-scheduler tries that node first, then the
        others)."""
        return self._patch_pod_status(pod, {"nominatedNodeName": node})

    def _patch_pod_status(self, pod: JsonObject, status: JsonObject) -> JsonObject:
        """A strategic merge patch of the pod's status, on the pod of that uid only."""
        meta = pod["metadata"]
        body = {"metadata": {"uid": meta["uid"]}, "status": status}
        path = CORE_V1 + "/namespaces/{namespace}/pods/{name}/status"
        return self._json(
            "PATCH", path, body, content_type=STRATEGIC_MERGE_PATCH, namespace=meta["namespace"], name=meta["name"]
        )

    def create_event(self, namespace: str, event: JsonObject) -> JsonObject:
        return self._call(self._core.create_namespaced_event, namespace, event)

    def scheduling_failures(self, namespace: str, pod: str) -> list[str]:
        """kube-scheduler's FailedScheduling messages on the pod, newest first."""
        selector = f"involvedObject.kind=Pod,involvedObject.name={pod},reason=FailedScheduling"
        events = self._call(self._core.list_namespaced_event, namespace, field_selector=selector).get("items") or []
        events.sort(key=lambda e: e.get("lastTimestamp") or e.get("eventTime") or "", reverse=True)
        return [str(e.get("message") or "") for e in events]

    def evict_pod(self, namespace: str, name: str) -> str | None:
        """Evict through the Eviction API, so that PodDisruptionBudgets hold: None when the pod
        goes, the API server's reason when a budget refuses it now (429)."""
        body = {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": name, "namespace": namespace}}
        try:
            self._call(self._core.create_namespaced_pod_eviction, name, namespace, body)
        except TooManyRequestsError as error:
            return error.reason
        return None

    def set_node_taints(self, node: JsonObject, taints: list[JsonObject]) -> JsonObject:
        """Replace the node's taints, on the node as read (its resourceVersion tested: the kubelet,
        an autoscaler or a person may be changing them too)."""
        meta = node["metadata"]
        patch = [
            {"op": "test", "path": "/metadata/resourceVersion", "value": meta["resourceVersion"]},
            {"op": "add", "path": "/spec/taints", "value": taints},  # add replaces a member that exists
        ]
        return self._call(self._core.patch_node, meta["name"], patch)

    def get_lease(self, namespace: str, name: str) -> JsonObject:
        return self._call(self._coordination.read_namespaced_lease, name, namespace)

    def create_lease(self, namespace: str, lease: JsonObject) -> JsonObject:
        return self._call(self._coordination.create_namespaced_lease, namespace, lease)

    def replace_lease(self, namespace: str, lease: JsonObject) -> JsonObject:
        return self._call(self._coordination.replace_namespaced_lease, lease["metadata"]["name"], namespace, lease)

    def create_ledger(self, namespace: str, ledger: JsonObject) -> JsonObject:
        return self._call(self._core.create_namespaced_config_map, namespace, ledger)

    def replace_ledger(self, namespace: str, ledger: JsonObject) -> JsonObject:
        name = ledger["metadata"]["name"]
        return self._call(self._core.replace_namespaced_config_map, name, namespace, ledger)

    def delete_configmap(self, namespace: str, configmap: JsonObject) -> None:
        """Delete the ConfigMap (a ledger, a usage history) as read: its uid and resourceVersion are
        preconditions, so one that anyone changed since is kept (ConflictError)."""
        meta = configmap["metadata"]
        body = {"preconditions": {"uid": meta["uid"], "resourceVersion": meta["resourceVersion"]}}
        self._call(self._core.delete_namespaced_config_map, meta["name"], namespace, body=body)
