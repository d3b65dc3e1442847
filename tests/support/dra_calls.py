"""kubelet's calls to the node's DRA service, in-process (the plugin's gRPC servicer without a
socket), and the samples a metrics registry holds before and after them."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from driver.claims.refs import ClaimRef
from driver.node.kubelet.api import dra_v1_pb2
from driver.node.kubelet.dra_service import DraV1Service
from testbed.fakes import CallContext


def claims_message(refs: list[ClaimRef]) -> list[dra_v1_pb2.Claim]:
    return [dra_v1_pb2.Claim(namespace=r.namespace, name=r.name, uid=r.uid) for r in refs]


def prepare(service: DraV1Service, refs: list[ClaimRef]) -> dict[str, str]:
    request = dra_v1_pb2.NodePrepareResourcesRequest(claims=claims_message(refs))
    return {uid: r.error for uid, r in service.NodePrepareResources(request, CallContext()).claims.items()}


def unprepare(service: DraV1Service, refs: list[ClaimRef]) -> dict[str, str]:
    request = dra_v1_pb2.NodeUnprepareResourcesRequest(claims=claims_message(refs))
    return {uid: r.error for uid, r in service.NodeUnprepareResources(request, CallContext()).claims.items()}


class Samples:
    """Sample values of a registry, and how much the process-wide counters moved since creation."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self._before = self._all()

    def _all(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in self.registry.collect()
            for s in family.samples
        }

    def value(self, name: str, **labels: str) -> float | None:
        return self.registry.get_sample_value(name, labels)

    def delta(self, name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return self._all().get(key, 0.0) - self._before.get(key, 0.0)

    def series(self, name: str) -> list[dict[str, str]]:
        return [s.labels for family in self.registry.collect() for s in family.samples if s.name == name]
