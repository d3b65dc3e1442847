"""Start-up before the NVIDIA driver is there: a GPU operator's driver container still installing
it, or a driver upgrade under way. The plugin waits for it instead of exiting: a DaemonSet
container that exits is restarted with a growing back-off (up to 5 minutes), which would keep the
node without a plugin long after the driver has loaded. Meanwhile its health port says SERVING
(alive: the liveness probe does not restart it) and `registered` NOT_SERVING (not Ready)."""

from __future__ import annotations

import logging
import threading

import grpc
import pynvml
from grpc_health.v1 import health, health_pb2

from driver.node.kubelet.liveness import READY_SERVICE, serve_health_port
from driver.nvml.session import DRIVER_GONE_ERRORS, NvmlSession, NvmlUnavailableError

log = logging.getLogger(__name__)

POLL_S = 2.0
# No driver loaded (the kernel module), or not installed yet (no NVML library on the driver root).
NOT_THERE_YET = DRIVER_GONE_ERRORS | {pynvml.NVML_ERROR_LIBRARY_NOT_FOUND}


def open_nvml(nvml: str) -> NvmlSession | str:
    """The NVML session, or while the driver is not (yet) there, why not. Other failures raise."""
    try:
        return NvmlSession.open(nvml)
    except NvmlUnavailableError as err:
        cause = err.__cause__
        if isinstance(cause, pynvml.NVMLError) and cause.value in NOT_THERE_YET:
            return str(cause)
        raise


def wait_for_driver(
    nvml: str, stopped: threading.Event, healthcheck_port: int, poll_s: float = POLL_S
) -> NvmlSession | None:
    """The NVML session once the driver answers (the plugin goes on with it); None when `stopped`
    is set first (SIGTERM)."""
    opened = open_nvml(nvml)
    if isinstance(opened, NvmlSession):
        return opened
    log.warning(
        "the NVIDIA driver is not loaded (%s): waiting for it; the plugin starts and registers with kubelet "
        "once NVML answers",
        opened,
    )
    server = _waiting_health(healthcheck_port) if healthcheck_port >= 0 else None
    try:
        while not isinstance(opened, NvmlSession):
            if stopped.wait(poll_s):
                return None
            opened = open_nvml(nvml)
    finally:
        if server is not None:
            server.stop(grace=0).wait()  # the port is the plugin's next
    log.info("the NVIDIA driver answers: starting")
    return opened


def _waiting_health(port: int) -> grpc.Server:
    servicer = health.HealthServicer()
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    servicer.set(READY_SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING)
    return serve_health_port(servicer, port)
