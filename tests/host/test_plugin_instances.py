"""Two plugin instances on one node (a DaemonSet rolling update): socket names per pod UID as
upstream's helper names them, sockets told apart by the file we bound, claim operations
serialised across processes, and a checkpoint cache that sees another process's write."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from driver.cli.main import build_parser
from driver.common.flags import SettingsError
from driver.node.settings import PluginSettings, plugin_settings

UID = "0b7c4c1e-9a52-4c8e-8f54-6a3f1d2e5b77"
# Expected names computed apart from the code under test, with openssl:
#   printf '%s' "$UID" | openssl dgst -sha256 -binary | head -c 8 | base64 | tr '+/' '-_' | tr -d '='
#   printf '%s\0%s' "$DRIVER" "$UID" | openssl dgst -sha256 -binary | head -c 16 | base64 | tr '+/' '-_' | tr -d '='


@pytest.fixture(autouse=True)
def no_uid_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in ("POD_UID", "STATE_DIR", "DRIVER_ROOT", "REGISTRATION_GRACE"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def settings(tmp_path: Path, *flags: str) -> PluginSettings:
    paths = [f"--{name}-dir={tmp_path / name}" for name in ("plugin", "cdi", "registrar")]  # a later flag wins
    argv = ["kubelet-plugin", "--node-name=node-a", "--nvml=mock:dgx-h100", *paths, *flags]
    return plugin_settings(build_parser().parse_args(argv))


@pytest.mark.root  # mounts an MPS tmpfs / uses kubelet's directories
def test_sockets_are_named_after_the_pod_uid(tmp_path: Path, no_uid_from_the_environment: pytest.MonkeyPatch):
    # kubelet's own directories: short enough for the full UID
    dirs = ("--registrar-dir=/var/lib/kubelet/plugins_registry", "--plugin-dir=/var/lib/kubelet/plugins/gpu.fgpu.dev")
    plain = settings(tmp_path, *dirs)
    assert plain.registration_socket == Path("/var/lib/kubelet/plugins_registry/gpu.fgpu.dev-reg.sock")
    assert plain.dra_socket == Path("/var/lib/kubelet/plugins/gpu.fgpu.dev/dra.sock")
    flagged = settings(tmp_path, *dirs, f"--rolling-update-uid={UID}")
    assert flagged.registration_socket == Path(f"/var/lib/kubelet/plugins_registry/gpu.fgpu.dev-{UID}-reg.sock")
    assert flagged.dra_socket == Path(f"/var/lib/kubelet/plugins/gpu.fgpu.dev/dra-{UID}.sock")
    no_uid_from_the_environment.setenv("POD_UID", UID)  # the downward API's metadata.uid
    assert settings(tmp_path, *dirs) == flagged
    with pytest.raises(SettingsError, match="is not a pod UID"):
        settings(tmp_path, "--rolling-update-uid=../../etc")
    assert plain.registration_grace_s == 60
    assert settings(tmp_path, *dirs, "--registration-grace=5").registration_grace_s == 5


def listen(path: Path) -> socket.socket:
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(path))
    server.listen(1)
    return server
