"""The DRAPlugin gRPC service, v1 and v1beta1, translating messages to ClaimPreparer calls."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import grpc

from driver.claims.refs import ClaimRef
from driver.node import metrics
from driver.node.kubelet.api import dra_v1_pb2, dra_v1_pb2_grpc, dra_v1beta1_pb2, dra_v1beta1_pb2_grpc
from driver.node.prepare import ClaimPreparer

Answered = Callable[[list[str], bool], None]


def _refs(claims: Any) -> list[ClaimRef]:
    return [ClaimRef(namespace=c.namespace, name=c.name, uid=c.uid) for c in claims]


def _make_servicer(base: type, messages: ModuleType, has_share_id: bool) -> type:
    """One servicer class per API version: the versions differ only in their message types and
    in v1's share_id field."""

    class Servicer(base):
        def __init__(self, preparer: ClaimPreparer, answered: Answered) -> None:
            self._preparer = preparer
            self._answered = answered

        def NodePrepareResources(self, request: Any, context: grpc.ServicerContext) -> Any:
            response = messages.NodePrepareResourcesResponse()
            with metrics.observed_request("NodePrepareResources", len(request.claims)) as outcome:
                results = self._preparer.prepare(_refs(request.claims))
                outcome.failed = any(result.error for result in results.values())
            # Whether kubelet sees this answer (not when it gave up on the call meanwhile).
            self._answered([uid for uid, result in results.items() if not result.error], context.is_active())
            for uid, result in results.items():
                entry = response.claims[uid]
                if result.error:
                    entry.error = result.error
                    continue
                for device in result.devices:
                    fields: dict[str, Any] = {
                        "request_names": list(device.request_names),
                        "pool_name": device.pool,
                        "device_name": device.device,
                        "cdi_device_ids": list(device.cdi_ids),
                    }
                    if has_share_id and device.share_id:
                        fields["share_id"] = device.share_id
                    entry.devices.append(messages.Device(**fields))
            return response

        def NodeUnprepareResources(self, request: Any, context: grpc.ServicerContext) -> Any:
            response = messages.NodeUnprepareResourcesResponse()
            with metrics.observed_request("NodeUnprepareResources", len(request.claims)) as outcome:
                errors = self._preparer.unprepare(_refs(request.claims))
                outcome.failed = any(errors.values())
            for uid, error in errors.items():
                response.claims[uid].error = error
            return response

    return Servicer


DraV1Service = _make_servicer(dra_v1_pb2_grpc.DRAPluginServicer, dra_v1_pb2, has_share_id=True)
DraV1beta1Service = _make_servicer(dra_v1beta1_pb2_grpc.DRAPluginServicer, dra_v1beta1_pb2, has_share_id=False)


def add_dra_services(server: grpc.Server, preparer: ClaimPreparer, answered: Answered) -> None:
    """`answered`: called after each prepare call with the claims prepared and whether kubelet
    still waited for the answer (False: it cancelled the call meanwhile)."""
    dra_v1_pb2_grpc.add_DRAPluginServicer_to_server(DraV1Service(preparer, answered), server)
    dra_v1beta1_pb2_grpc.add_DRAPluginServicer_to_server(DraV1beta1Service(preparer, answered), server)
