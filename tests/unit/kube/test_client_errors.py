"""The client's errors as callers see them: a response cut off while its body is read is the API
server unreachable (KubeUnavailableError, retried like any outage), never an exception of the HTTP
library that a caller catching KubeError lets through (a writer's future would swallow it)."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from driver.controller.api import ClientControllerApi
from driver.kube.errors import KubeUnavailableError


@pytest.fixture
def cut_off_server() -> Iterator[str]:
    """An HTTP server that promises a 1,000-byte JSON body, sends 20 bytes and closes: its URL."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.1)  # accept() wakes to see `stop`
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                connection, _ = listener.accept()
            except TimeoutError:
                continue
            with connection:
                connection.recv(65536)
                head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
                connection.sendall(head + b'{"metadata": {"name"')

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    stop.set()
    thread.join(timeout=5)
    listener.close()


def test_a_body_cut_off_is_the_api_server_unreachable(cut_off_server: str, tmp_path: Path):
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "c",
            "clusters": [{"name": "c", "cluster": {"server": cut_off_server}}],
            "users": [{"name": "u", "user": {"token": "t"}}],
            "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
        })
    )  # fmt: skip
    api = ClientControllerApi(str(kubeconfig), timeout_s=5)
    pod = {"metadata": {"name": "p", "namespace": "ml", "resourceVersion": "7"}, "spec": {"schedulingGates": []}}
    try:
        with pytest.raises(KubeUnavailableError):
            api.set_scheduling_gates(pod, [])
    finally:
        api.close()
