"""The plugin-watcher registration service kubelet calls on the registration socket."""

from __future__ import annotations

import logging

import grpc

from driver.node.kubelet.api import pluginregistration_v1_pb2 as reg_pb
from driver.node.kubelet.api import pluginregistration_v1_pb2_grpc as reg_grpc
from driver.node.kubelet.liveness import RegistrationState

log = logging.getLogger(__name__)

# Kubelet takes the first DRAPlugin version it supports, so the newest comes first; optional
# services (the health stream) follow.
DRA_SERVICES = ("v1.DRAPlugin", "v1beta1.DRAPlugin")


class RegistrationService(reg_grpc.RegistrationServicer):
    def __init__(
        self, driver_name: str, endpoint: str, state: RegistrationState, optional_services: tuple[str, ...] = ()
    ) -> None:
        self._driver_name = driver_name
        self._endpoint = endpoint
        self._state = state
        self._services = DRA_SERVICES + optional_services

    def GetInfo(self, request: reg_pb.InfoRequest, context: grpc.ServicerContext) -> reg_pb.PluginInfo:
        return reg_pb.PluginInfo(
            type="DRAPlugin",
            name=self._driver_name,
            endpoint=self._endpoint,
            supported_versions=list(self._services),
        )

    def NotifyRegistrationStatus(
        self, request: reg_pb.RegistrationStatus, context: grpc.ServicerContext
    ) -> reg_pb.RegistrationStatusResponse:
        if request.plugin_registered:
            log.info("registered with kubelet")
        else:
            log.error("kubelet rejected the registration: %s", request.error)
        self._state.record(request.plugin_registered, request.error)
        return reg_pb.RegistrationStatusResponse()
