"""HTTP servers that anyone on the network can connect to (the webhook's HTTPS port, the plugin's
/metrics): a bounded number of connections, each closed once idle.

http.server's ThreadingHTTPServer starts a thread for every connection it accepts and keeps each as
long as its client likes, so a client that opens connections and sends nothing holds threads and
memory without end. Here a connection beyond `max_connections` is closed as soon as it is accepted,
and one that sends nothing for `idle_timeout_s` (between requests, or within one) is closed.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

LOG = logging.getLogger(__name__)


@dataclass(frozen=True)
class ConnectionLimits:
    max_connections: int
    idle_timeout_s: float


class BoundedHTTPServer(ThreadingHTTPServer):
    """ThreadingHTTPServer with at most `limits.max_connections` open at once, each closed after
    `limits.idle_timeout_s` without a byte from its client."""

    daemon_threads = True

    def __init__(
        self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler], limits: ConnectionLimits
    ) -> None:
        self.limits = limits
        self._slots = threading.BoundedSemaphore(limits.max_connections)
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        # Refused at once rather than queued: accept() must go on, and a client waiting in the
        # backlog for a slot gains nothing over one that connects again.
        if not self._slots.acquire(blocking=False):
            LOG.debug("connection from %s refused: %d open", client_address[0], self.limits.max_connections)
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)  # a thread that releases the slot
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def finish_request(self, request: Any, client_address: Any) -> None:
        # A socket timeout bounds every read: BaseHTTPRequestHandler closes a connection whose next
        # request line does not come in time, and a request whose body stalls fails.
        request.settimeout(self.limits.idle_timeout_s)
        super().finish_request(request, client_address)
