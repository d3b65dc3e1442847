"""The node plugin holds only what it uses (issue 38: 122 MB idle before): `fgpu`'s parser lists
every command without importing the allocator and CEL (16 MiB), and the plugin's API client sends
its requests without the client library's generated API classes (25 MiB, CoreV1Api 20 of them).
The figures themselves are in bench/plugin_footprint.py, not in a timed test."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.support import ROOT

# Imported on the plugin's path before: what `fgpu plan`, `fgpu status` and the controller need.
HEAVY = ("driver.allocator.cel", "driver.allocator.allocate", "driver.cli.status", "driver.cli.plan")
GENERATED_APIS = ("kubernetes.client.api.core_v1_api", "kubernetes.client.api.resource_v1_api")

PLUGIN_PATH = """
import json, sys
from driver.cli.main import build_parser
from driver.kube.client import ClientKubeApi
from driver.kube.errors import KubeUnavailableError
from driver.node.server import run_plugin

build_parser().parse_args(["kubelet-plugin", "--node-name=n1"])
api = ClientKubeApi(sys.argv[1], timeout_s=2)
event = {"metadata": {"name": "e"}, "involvedObject": {"kind": "Pod"}}
for call in (lambda: api.get_node("n1"), lambda: api.list_slices("gpu.fgpu.dev", "n1"),
             lambda: api.create_event("default", event), lambda: api.list_all_claims(True)):
    try:
        call()
    except KubeUnavailableError:
        pass  # no API server: the request was made, which is what counts here
print(json.dumps(sorted(sys.modules)))
"""


def test_the_plugin_imports_neither_other_commands_nor_generated_api_classes(tmp_path: Path):
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        json.dumps(
            {
                "clusters": [{"name": "c", "cluster": {"server": "http://127.0.0.1:9"}}],  # discard: refused
                "users": [{"name": "u", "user": {"token": "t"}}],
                "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "x",
            }
        )
    )
    run = subprocess.run(
        [sys.executable, "-c", PLUGIN_PATH, str(kubeconfig)], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert run.returncode == 0, run.stderr
    modules = set(json.loads(run.stdout))
    assert "driver.node.server" in modules and "kubernetes" in modules
    assert not modules & {*HEAVY, *GENERATED_APIS}
