"""A kubelet stand-in for DRA: what kubelet does with a DRA plugin, over the plugin's real sockets.

- watches the plugin registry directory; for each socket: GetInfo, validation, the first version
  it supports, NotifyRegistrationStatus;
- deletes its node's ResourceSlices when it starts (as kubelet does);
- for each pod bound to its node whose claims are allocated and reserved for the pod, calls
  NodePrepareResources on the claims' drivers and records the CDI IDs, then marks the pod Running;
- when a pod is deleted, calls NodeUnprepareResources for the claims no other pod on the node uses,
  then removes the pod (kubelet's final delete).
"""

from __future__ import annotations

import argparse
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import kubernetes

from driver.node.kubelet.api import dra_v1_pb2, dra_v1_pb2_grpc, dra_v1beta1_pb2, dra_v1beta1_pb2_grpc
from driver.node.kubelet.api import pluginregistration_v1_pb2 as reg_pb
from driver.node.kubelet.api import pluginregistration_v1_pb2_grpc as reg_grpc

log = logging.getLogger(__name__)

# What this kubelet speaks, in its order of preference.
KUBELET_VERSIONS = {
    "v1.DRAPlugin": (dra_v1_pb2, dra_v1_pb2_grpc),
    "v1beta1.DRAPlugin": (dra_v1beta1_pb2, dra_v1beta1_pb2_grpc),
}
CALL_TIMEOUT_S = 45  # kubelet's per-call timeout


@dataclass
class Plugin:
    name: str
    endpoint: str
    version: str
    channel: grpc.Channel

    def call(self, method: str, claims: list[dict[str, str]]) -> Any:
        messages, stubs = KUBELET_VERSIONS[self.version]
        stub = stubs.DRAPluginStub(self.channel)
        request_type = (
            messages.NodePrepareResourcesRequest if method == "prepare" else messages.NodeUnprepareResourcesRequest
        )
        request = request_type(claims=[messages.Claim(**c) for c in claims])
        rpc = stub.NodePrepareResources if method == "prepare" else stub.NodeUnprepareResources
        return rpc(request, timeout=CALL_TIMEOUT_S)


@dataclass
class PreparedPod:
    namespace: str
    name: str
    uid: str
    claims: dict[str, dict[str, str]]  # claim uid -> {namespace, name, uid, driver}
    cdi_ids: list[str] = field(default_factory=list)


class KubeletStandIn:
    def __init__(self, node: str, kubeconfig: str, registrar_dir: Path, poll_s: float = 0.2) -> None:
        self.node = node
        self.registrar_dir = registrar_dir
        configuration = kubernetes.client.Configuration()
        kubernetes.config.load_kube_config(config_file=kubeconfig, client_configuration=configuration)
        client = kubernetes.client.ApiClient(configuration)
        self.core = kubernetes.client.CoreV1Api(client)
        self.resource = kubernetes.client.ResourceV1Api(client)
        self.poll_s = poll_s
        self.plugins: dict[str, Plugin] = {}
        self.prepared: dict[str, PreparedPod] = {}  # pod uid -> what was prepared
        self.errors: list[str] = []
        self._sockets: dict[Path, str] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.lock = threading.Lock()

    # --- lifecycle ------------------------------------------------------------------------------

    def start(self) -> KubeletStandIn:
        self.resource.delete_collection_resource_slice(field_selector=f"spec.nodeName={self.node}")
        self._thread = threading.Thread(target=self._run, name=f"kubelet-{self.node}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(10)
        for plugin in self.plugins.values():
            plugin.channel.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._sync_plugins()
                self._sync_pods()
            except Exception as err:  # keep going like kubelet does; tests read .errors
                log.exception("kubelet stand-in sync failed")
                self.errors.append(str(err))
            self._stop.wait(self.poll_s)

    # --- plugin registration --------------------------------------------------------------------

    def _sync_plugins(self) -> None:
        present = {p for p in self.registrar_dir.glob("*.sock") if not p.name.startswith(".")}
        for path in set(self._sockets) - present:
            name = self._sockets.pop(path)
            plugin = self.plugins.pop(name, None)
            if plugin:
                plugin.channel.close()
            log.info("plugin %s deregistered (socket %s gone)", name, path)
        for path in present - set(self._sockets):
            self._register(path)

    def _register(self, path: Path) -> None:
        with grpc.insecure_channel(f"unix://{path}") as channel:
            stub = reg_grpc.RegistrationStub(channel)
            try:
                info = stub.GetInfo(reg_pb.InfoRequest(), timeout=5)
            except grpc.RpcError as err:
                log.warning("GetInfo on %s failed: %s", path, err)
                return
            version = next((v for v in info.supported_versions if v in KUBELET_VERSIONS), None)
            error = ""
            if info.type != "DRAPlugin":
                error = f"unsupported plugin type {info.type!r}"
            elif version is None:
                error = f"no supported version in {list(info.supported_versions)}"
            stub.NotifyRegistrationStatus(
                reg_pb.RegistrationStatus(plugin_registered=not error, error=error), timeout=5
            )
        if error:
            log.warning("rejected plugin at %s: %s", path, error)
            return
        self._sockets[path] = info.name
        old = self.plugins.get(info.name)
        if old:
            old.channel.close()
        self.plugins[info.name] = Plugin(
            info.name, info.endpoint, version, grpc.insecure_channel(f"unix://{info.endpoint}")
        )
        log.info("registered plugin %s at %s (%s)", info.name, info.endpoint, version)

    # --- pods -----------------------------------------------------------------------------------

    def _sync_pods(self) -> None:
        pods = self.core.list_pod_for_all_namespaces(field_selector=f"spec.nodeName={self.node}").items
        live = {pod.metadata.uid: pod for pod in pods}
        for uid in list(self.prepared):
            pod = live.get(uid)
            if pod is None or pod.metadata.deletion_timestamp is not None:
                self._teardown(uid, pod)
        for pod in pods:
            if pod.metadata.deletion_timestamp is not None:
                if pod.metadata.uid not in self.prepared:
                    self._final_delete(pod)
            elif pod.metadata.uid not in self.prepared:
                self._prepare(pod)

    def _pod_claims(self, pod: Any) -> list[Any] | None:
        """The pod's ResourceClaims, or None while one is not there yet or not allocated/reserved."""
        statuses = {s.name: s.resource_claim_name for s in (pod.status.resource_claim_statuses or [])}
        claims = []
        for entry in pod.spec.resource_claims or []:
            name = entry.resource_claim_name or statuses.get(entry.name)
            if not name:
                return None
            try:
                claim = self.resource.read_namespaced_resource_claim(name, pod.metadata.namespace)
            except kubernetes.client.ApiException:
                return None
            reserved = {r.uid for r in (claim.status.reserved_for or [])} if claim.status else set()
            if not claim.status or not claim.status.allocation or pod.metadata.uid not in reserved:
                return None
            claims.append(claim)
        return claims

    def _prepare(self, pod: Any) -> None:
        claims = self._pod_claims(pod)
        if claims is None:
            return
        by_driver: dict[str, list[dict[str, str]]] = {}
        refs: dict[str, dict[str, str]] = {}
        for claim in claims:
            ref = {"namespace": claim.metadata.namespace, "name": claim.metadata.name, "uid": claim.metadata.uid}
            for driver in sorted({r.driver for r in claim.status.allocation.devices.results or []}):
                by_driver.setdefault(driver, []).append(ref)
                refs[claim.metadata.uid] = {**ref, "driver": driver}
        cdi_ids: list[str] = []
        for driver, driver_claims in by_driver.items():
            plugin = self.plugins.get(driver)
            if plugin is None:
                return  # kubelet waits for the driver to register
            try:
                response = plugin.call("prepare", driver_claims)
            except grpc.RpcError as err:
                self.errors.append(f"prepare {pod.metadata.name}: {err}")
                return
            for ref in driver_claims:
                if ref["uid"] not in response.claims:
                    self.errors.append(f"prepare {pod.metadata.name}: no result for claim {ref['name']}")
                    return
                result = response.claims[ref["uid"]]
                if result.error:
                    self.errors.append(f"prepare {pod.metadata.name}: {result.error}")
                    return
                cdi_ids.extend(i for device in result.devices for i in device.cdi_device_ids)
        with self.lock:
            self.prepared[pod.metadata.uid] = PreparedPod(
                pod.metadata.namespace, pod.metadata.name, pod.metadata.uid, refs, cdi_ids
            )
        self.core.patch_namespaced_pod_status(
            pod.metadata.name,
            pod.metadata.namespace,
            {"status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}},
        )
        log.info("pod %s/%s prepared: %s", pod.metadata.namespace, pod.metadata.name, cdi_ids)

    def _teardown(self, uid: str, pod: Any) -> None:
        prepared = self.prepared[uid]
        others = {c for other_uid, p in self.prepared.items() if other_uid != uid for c in p.claims}
        by_driver: dict[str, list[dict[str, str]]] = {}
        for claim_uid, ref in prepared.claims.items():
            if claim_uid not in others:
                by_driver.setdefault(ref["driver"], []).append({k: ref[k] for k in ("namespace", "name", "uid")})
        for driver, claims in by_driver.items():
            plugin = self.plugins.get(driver)
            if plugin is None:
                return
            try:
                response = plugin.call("unprepare", claims)
            except grpc.RpcError as err:
                self.errors.append(f"unprepare {prepared.name}: {err}")
                return
            failed = [response.claims[c["uid"]].error for c in claims if response.claims[c["uid"]].error]
            if failed:
                self.errors.append(f"unprepare {prepared.name}: {failed}")
                return
        with self.lock:
            del self.prepared[uid]
        log.info("pod %s/%s unprepared", prepared.namespace, prepared.name)
        if pod is not None:
            self._final_delete(pod)

    def _final_delete(self, pod: Any) -> None:
        try:
            self.core.delete_namespaced_pod(pod.metadata.name, pod.metadata.namespace, grace_period_seconds=0)
        except kubernetes.client.ApiException as err:
            if err.status != 404:
                raise


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    parser = argparse.ArgumentParser(prog="python -m testbed.cluster.kubelet_standin")
    parser.add_argument("--node", required=True)
    parser.add_argument("--kubeconfig", required=True)
    parser.add_argument("--registrar-dir", required=True, type=Path)
    args = parser.parse_args()
    standin = KubeletStandIn(args.node, args.kubeconfig, args.registrar_dir).start()
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        standin.stop()


if __name__ == "__main__":
    main()
