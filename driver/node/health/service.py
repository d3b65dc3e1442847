"""kubelet's resource-health stream (DRAResourceHealth.NodeWatchResources, v1 and v1alpha1).

Kubelet (ResourceHealthStatus gate) opens the stream when the registration lists the service,
and marks a device's health Unknown when it hears nothing of it for health_check_timeout_seconds,
so every message carries every device and one is sent on each change and every KEEPALIVE_S."""

from __future__ import annotations

from collections.abc import Iterator
from types import ModuleType
from typing import Any

import grpc

from driver.node.health.monitor import HealthBoard, HealthSnapshot
from driver.node.kubelet.api import (
    dra_health_v1_pb2,
    dra_health_v1_pb2_grpc,
    dra_health_v1alpha1_pb2,
    dra_health_v1alpha1_pb2_grpc,
)

KEEPALIVE_S = 10.0
HEALTH_TIMEOUT_S = 30  # what kubelet waits, per device, for the next word
MAX_MESSAGE = 1024  # kubelet truncates longer messages


def _make_servicer(base: type, messages: ModuleType) -> type:
    class Servicer(base):
        def __init__(self, board: HealthBoard, pool: str) -> None:
            self._board, self._pool = board, pool

        def NodeWatchResources(self, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            version = -1
            while context.is_active():
                snapshot = self._board.wait_newer(version, KEEPALIVE_S)
                version = snapshot.version
                yield self._response(snapshot)

        def _response(self, snapshot: HealthSnapshot) -> Any:
            healthy, unhealthy = messages.HealthStatus.Value("HEALTHY"), messages.HealthStatus.Value("UNHEALTHY")
            return messages.NodeWatchResourcesResponse(
                devices=[
                    messages.DeviceHealth(
                        device=messages.DeviceIdentifier(pool_name=self._pool, device_name=name),
                        health=healthy if report.healthy else unhealthy,
                        last_updated_time=int(snapshot.taken_at),
                        health_check_timeout_seconds=HEALTH_TIMEOUT_S,
                        message=report.message[:MAX_MESSAGE],
                    )
                    for name, report in sorted(snapshot.devices.items())
                ]
            )

    return Servicer


HealthV1Service = _make_servicer(dra_health_v1_pb2_grpc.DRAResourceHealthServicer, dra_health_v1_pb2)
HealthV1alpha1Service = _make_servicer(dra_health_v1alpha1_pb2_grpc.DRAResourceHealthServicer, dra_health_v1alpha1_pb2)
# Listed in the registration after the DRAPlugin versions, newest first: kubelet picks the newest it knows.
HEALTH_SERVICES = ("v1.DRAResourceHealth", "v1alpha1.DRAResourceHealth")


def add_health_services(server: grpc.Server, board: HealthBoard, pool: str) -> None:
    dra_health_v1_pb2_grpc.add_DRAResourceHealthServicer_to_server(HealthV1Service(board, pool), server)
    dra_health_v1alpha1_pb2_grpc.add_DRAResourceHealthServicer_to_server(HealthV1alpha1Service(board, pool), server)
