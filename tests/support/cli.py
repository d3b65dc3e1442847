"""The `fgpu` command as users run it."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.support import ROOT

KUBECONFIG = (  # never dialled: the plugin stops before it serves
    "apiVersion: v1\nkind: Config\ncurrent-context: c\nclusters: [{name: k, cluster: {server: 'https://127.0.0.1:1'}}]\n"
    "users: [{name: u, user: {token: t}}]\ncontexts: [{name: c, context: {cluster: k, user: u}}]\n"
)


def status(*flags: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "driver.cli", "status", *flags]
    return subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=ROOT, env=env)


def fgpu(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """`fgpu ARGS` with `env` over this process's environment; a failure raises."""
    command = [sys.executable, "-m", "driver.cli", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=60, env={**os.environ, **env}, check=True)
