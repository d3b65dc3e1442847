"""The Helm chart (daemonset/chart/fgpu) through the test bed's helm (testbed/cluster/build.sh builds
it): render, lint, install. Shared by the chart's unit tests and the install tests."""

from __future__ import annotations

import functools
import json
import os
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from testbed.cluster.harness import build_binaries

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "daemonset" / "chart" / "fgpu"
RENDER = ROOT / "daemonset" / "render.sh"
NAMESPACE = "fgpu-system"
KUBE_VERSION = "1.36.0"  # the oldest the chart supports (Chart.yaml kubeVersion)
HELM_HOME = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "fgpu" / "helm-home"


@functools.cache
def helm_binary() -> Path:
    return build_binaries() / "helm"


def helm_command(*args: str, kubeconfig: Path | None = None) -> tuple[list[str], dict[str, str]]:
    """argv and environment for helm; its state (repositories, cache, config) in a directory of
    its own, not ~."""
    env = {
        **os.environ,
        "HELM_CACHE_HOME": str(HELM_HOME / "cache"),
        "HELM_CONFIG_HOME": str(HELM_HOME / "config"),
        "HELM_DATA_HOME": str(HELM_HOME / "data"),
    }
    if kubeconfig is not None:
        env["KUBECONFIG"] = str(kubeconfig)
    return [str(helm_binary()), *args], env


def helm(*args: str, kubeconfig: Path | None = None, timeout_s: float = 300) -> str:
    argv, env = helm_command(*args, kubeconfig=kubeconfig)
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout_s, check=False)
    if done.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    return done.stdout


def set_flags(values: Mapping[str, object]) -> list[str]:
    """--set-json flags for values given as dotted keys: {"controller.replicas": 1}."""
    return [f"--set-json={key}={json.dumps(value)}" for key, value in values.items()]


def render(values: Mapping[str, object] | None = None, namespace: str = NAMESPACE) -> list[dict[str, Any]]:
    """The chart's objects for `values`, as helm template writes them."""
    # --kube-version: without a cluster helm assumes an old one, below the chart's kubeVersion.
    flags = ["--namespace", namespace, "--kube-version", KUBE_VERSION, *set_flags(values or {})]
    text = helm("template", "fgpu", str(CHART), *flags)
    return [doc for doc in yaml.safe_load_all(text) if doc]


def find(objects: Sequence[dict[str, Any]], kind: str, name_part: str = "") -> dict[str, Any]:
    matches = [o for o in objects if o["kind"] == kind and name_part in o["metadata"]["name"]]
    assert len(matches) == 1, f"expected one {kind} named *{name_part}*, got {[o['metadata']['name'] for o in matches]}"
    return matches[0]


def container_env(workload: dict[str, Any]) -> dict[str, Any]:
    """name -> value (or valueFrom) of the workload's first container."""
    container = workload["spec"]["template"]["spec"]["containers"][0]
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}
