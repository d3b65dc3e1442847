"""Shared fixtures: the real control plane (session-wide) and plugin processes; the test tiers.

Markers say what a test needs (pyproject.toml): `cluster`, `real_node`, `root` tests get the
host check (the run leaves no process, mount, iptables chain, sysctl or cgroup behind; it waits
for the host lock while another test node holds it); unmarked tests are pure and never wait.
`--no-builds` (make unit) builds nothing from Go: a `go` test runs with binaries already built,
else it is skipped and says why."""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

# Before grpc is imported: the tests start plugins with a preexec_fn (a plain fork, so atfork
# handlers run), and grpc's fork support restarts its poller in the child, which the child's
# closing of inherited descriptors then breaks: the child aborted before exec ("plugin exited with
# -6", "epoll_wait error: Bad file descriptor"), once in a full run. The child execs at once and
# needs nothing of grpc.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

import kubernetes
import pytest
import yaml

from testbed.cluster.harness import NO_BUILDS_ENV, Cluster, built_binaries
from testbed.cluster.host_state import RUN_MARKER, HostState
from testbed.cluster.node import RealNode
from testbed.fakes import InMemoryKubeApi
from testbed.node_env import NodeEnv, build_node, fake_tools_env, stop_fake_daemons
from testbed.plugin_process import PluginUnderTest
from tests.support import ROOT

NODES = ("node-a", "node-b")
CHANGE_THE_HOST = ("cluster", "real_node", "root")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--no-builds", action="store_true", help="build nothing from Go; skip go tests if unbuilt")


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("--no-builds"):
        os.environ[NO_BUILDS_ENV] = "1"  # build_binaries() then only finds what was built


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not config.getoption("--no-builds") or built_binaries() is not None:
        return
    skip = pytest.mark.skip(reason="needs binaries built from Go (make cluster); --no-builds builds none")
    for item in items:
        if item.get_closest_marker("go"):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory, host_left_as_found: None) -> Iterator[Cluster]:
    control_plane = Cluster(tmp_path_factory.mktemp("cluster")).start()
    try:
        for node in NODES:
            control_plane.add_node(node, labels={"nvidia.com/gpu.present": "true"})
        client = control_plane.api_client()
        for document in yaml.safe_load_all((ROOT / "daemonset" / "deviceclasses.yaml").read_text()):
            kubernetes.utils.create_from_dict(client, document)
        yield control_plane
    finally:
        control_plane.stop()


@pytest.fixture(scope="module")
def real_node(cluster: Cluster) -> Iterator[RealNode]:
    """kubelet and containerd from upstream, registered with the test control plane. One module at
    a time: two real nodes on one host would share kubelet's hard-coded paths and cgroups."""
    node = RealNode(cluster).start()
    try:
        yield node
    finally:
        node.stop()


@pytest.fixture(scope="session")
def host_left_as_found() -> Iterator[None]:
    """The whole run leaves no sysctl, iptables chain, mount, network device or cgroup behind."""
    os.environ.setdefault(RUN_MARKER, uuid.uuid4().hex)
    before = HostState.take_quiet()
    yield
    left = before.differences(HostState.take_quiet())
    assert not left, "the test run left this behind on the host:\n" + "\n".join(left)


@pytest.fixture(autouse=True)
def _host_checked(request: pytest.FixtureRequest) -> None:
    """Tests that change the host take part in the run's host check; pure ones stay out of it."""
    if any(request.node.get_closest_marker(marker) for marker in CHANGE_THE_HOST):
        request.getfixturevalue("host_left_as_found")


@pytest.fixture
def resource_api(cluster: Cluster) -> kubernetes.client.ResourceV1Api:
    return kubernetes.client.ResourceV1Api(cluster.api_client())


@pytest.fixture
def core_api(cluster: Cluster) -> kubernetes.client.CoreV1Api:
    return kubernetes.client.CoreV1Api(cluster.api_client())


@pytest.fixture
def start_plugin(cluster: Cluster) -> Iterator:
    started: list[PluginUnderTest] = []

    def start(node: str = "node-a", wait: bool = True, **kwargs: object) -> PluginUnderTest:
        plugin = PluginUnderTest(node=node, kubeconfig=str(cluster.kubeconfig), **kwargs).start(wait)
        started.append(plugin)
        return plugin

    yield start
    for plugin in started:
        plugin.stop()
        shutil.rmtree(plugin.root, ignore_errors=True)


@pytest.fixture
def node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[InMemoryKubeApi, NodeEnv]]:
    """An in-memory API and a node's driver on mock dgx-h100 with the fake tools on PATH."""
    for key, value in fake_tools_env(tmp_path).items():
        monkeypatch.setenv(key, value)
    api = InMemoryKubeApi()
    yield api, build_node(tmp_path, api)
    stop_fake_daemons(tmp_path)
