"""The controller's unit tests: a dgx-h100's slices, and replicas that believe they lead."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from driver.common.testhooks import NO_TEST_HOOKS, TestHooks
from driver.controller.controller import Controller
from testbed.controller_api import InMemoryControllerApi
from tests.support.controller_cluster import discover, sync


@pytest.fixture(scope="module")
def h100_slices(tmp_path_factory: pytest.TempPathFactory) -> str:
    return discover(tmp_path_factory.mktemp("slices"), "n1", "dgx-h100").read_text()


@pytest.fixture
def replicas() -> Iterator[Any]:
    """Controllers that believe they lead (the lease: test_leader.py), synced with the in-memory API."""
    started: list[Controller] = []

    def start(
        api: InMemoryControllerApi,
        identity: str = "a",
        evictions_per_minute: int = 0,
        compact: bool = False,
        hooks: TestHooks = NO_TEST_HOOKS,
        **options: Any,
    ) -> Controller:
        controller = Controller(
            api,
            identity,
            lease_namespace="fgpu",
            evictions_per_minute=evictions_per_minute,
            compact=compact,
            hooks=hooks,
            **options,
        )
        controller.leader.leading = lambda: True  # type: ignore[method-assign]
        sync(controller)
        started.append(controller)
        return controller

    yield start
    for controller in started:
        controller.stop()
        controller.writers.shutdown(wait=True)
