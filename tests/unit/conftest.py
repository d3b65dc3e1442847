from collections.abc import Iterator
from pathlib import Path

import pytest

from testbed.fakes import InMemoryKubeApi
from testbed.node_env import NodeEnv, build_node, fake_tools_env, stop_fake_daemons


@pytest.fixture
def node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[InMemoryKubeApi, NodeEnv]]:
    """An in-memory API and a node's driver on mock dgx-h100 with the fake tools on PATH."""
    for key, value in fake_tools_env(tmp_path).items():
        monkeypatch.setenv(key, value)
    api = InMemoryKubeApi()
    yield api, build_node(tmp_path, api)
    stop_fake_daemons(tmp_path)
