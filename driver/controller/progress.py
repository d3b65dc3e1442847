"""Whether the controller's loop makes progress: the liveness probe's answer (GET /healthz on the
health port), and the leader's condition for renewing its Lease (leader.py).

The loop beats at every turn (at least every 5 s while idle), a pass after every unit it places
or makes room for, and before and after the allocator is built. A replica that has not beaten
for `stall_s` is stalled: its probe fails (kubelet restarts it) and, sooner, its elector stops
renewing the Lease and stops acting, so that a standby takes over within one lease duration
although the stuck thread still holds the process. Each unit's search is bounded (search_shares.py),
so only a fault stalls a healthy controller this long."""

from __future__ import annotations

import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler

from driver.common.http_server import BoundedHTTPServer, ConnectionLimits
from driver.controller.clock import monotonic

STALL_S = 120.0  # a new leader's first pass gathers every pool and claim: tens of seconds at 5,000 nodes
HEALTH_LIMITS = ConnectionLimits(max_connections=4, idle_timeout_s=5.0)  # kubelet's probe, one at a time


class Progress:
    def __init__(self, stall_s: float = STALL_S, clock: Callable[[], float] = monotonic) -> None:
        self.stall_s, self._clock = stall_s, clock
        self._beat = clock()

    def beat(self) -> None:
        self._beat = self._clock()

    def silent_for(self) -> float:
        """Seconds since the last beat."""
        return self._clock() - self._beat

    def stalled(self) -> bool:
        return self.silent_for() > self.stall_s


def serve_health(port: int, progress: Progress) -> BoundedHTTPServer:
    """GET /healthz on `port` (0: any free port): 200 while the loop makes progress, 503 once it
    is stalled. Served from a daemon thread; returns the server (its port, shutdown)."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path != "/healthz":
                self.send_error(404)
                return
            ok = not progress.stalled()
            body = ("ok\n" if ok else f"stalled: no progress for {progress.silent_for():.0f} s\n").encode()
            self.send_response(200 if ok else 503)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            return  # a probe every few seconds is not worth a log line

    server = BoundedHTTPServer(("", port), Handler, HEALTH_LIMITS)
    threading.Thread(target=server.serve_forever, name="health", daemon=True).start()
    return server
