"""What the API server delivered (list, watch), apart from our own writes: Informer.wait_delivered."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from driver.kube.informer import Informer

LONG_S = 10.0  # a wait that must end well before this (woken by an event), never by its timeout


def claim(name: str, version: int) -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": "ml", "resourceVersion": str(version)}}


class WatchedApi:
    """Lists what it is given; its watch sends what the test sends, in order, until closed."""

    def __init__(self, *listed: dict[str, Any]) -> None:
        self.listed = list(listed)
        self._events: queue.Queue[tuple[str, dict[str, Any]] | None] = queue.Queue()

    def list_pages(
        self, kind: str, label_selector: str = "", namespace: str = "", limit: int = 500
    ) -> Iterator[tuple[list[dict[str, Any]], str]]:
        yield self.listed, "100"

    def watch(
        self, kind: str, resource_version: str, timeout_s: int, label_selector: str = "", namespace: str = ""
    ) -> Iterator[tuple[str, dict[str, Any]]]:
        while (event := self._events.get()) is not None:
            yield event

    def send(self, event_type: str, obj: dict[str, Any]) -> None:
        self._events.put((event_type, obj))

    def close(self) -> None:
        self._events.put(None)


@pytest.fixture
def watched() -> Iterator[tuple[WatchedApi, Informer]]:
    """A running claims informer whose list held ml/listed at version 100."""
    api = WatchedApi(claim("listed", 100))
    informer = Informer(api, "claims", threading.Event())
    informer.start()
    assert informer.synced.wait(LONG_S)
    yield api, informer
    informer.stop()
    api.close()  # the watch returns, the stopped informer ends


def test_listed_and_watched_objects_count_as_delivered(watched):
    api, informer = watched
    assert informer.wait_delivered(claim("listed", 100), 0.0)
    api.send("ADDED", claim("a", 101))
    assert informer.wait_delivered(claim("a", 101), LONG_S)
    assert informer.wait_delivered(claim("a", 99), 0.0)  # an older version: delivered already
    assert informer.delivered_version("ml/a") == 101


def test_a_waiter_is_woken_by_the_watch_event(watched):
    api, informer = watched
    result: list[bool] = []
    informer.update(claim("listed", 105))  # our own write: held at once, not delivered
    waiter = threading.Thread(target=lambda: result.append(informer.wait_delivered(claim("listed", 105), LONG_S)))
    started = time.monotonic()
    waiter.start()
    api.send("MODIFIED", claim("listed", 105))
    waiter.join(LONG_S)
    assert result == [True]
    assert time.monotonic() - started < LONG_S / 2  # woken, not timed out


def test_our_own_write_is_not_delivered(watched):
    api, informer = watched
    informer.update(claim("listed", 105))
    assert informer.get("ml/listed")["metadata"]["resourceVersion"] == "105"  # the cache has it
    assert not informer.wait_delivered(claim("listed", 105), 0.05)  # the watch did not bring it
    assert informer.delivered_version("ml/listed") == 100
    api.send("MODIFIED", claim("listed", 104))  # an earlier change, arriving after our write
    api.send("MODIFIED", claim("listed", 106))  # and a later one: ours has come and gone
    assert informer.wait_delivered(claim("listed", 105), LONG_S)
    assert informer.get("ml/listed")["metadata"]["resourceVersion"] == "106"


def test_deleted_objects_are_forgotten(watched):
    api, informer = watched
    api.send("ADDED", claim("a", 101))
    assert informer.wait_delivered(claim("a", 101), LONG_S)
    api.send("DELETED", claim("a", 107))
    api.send("ADDED", claim("b", 109))  # after a's deletion, in order: once b is here, a is gone
    assert informer.wait_delivered(claim("b", 109), LONG_S)
    assert informer.delivered_version("ml/a") is None
    assert not informer.wait_delivered(claim("a", 101), 0.0)
    informer.forget(claim("b", 110))  # our own delete forgets too
    assert informer.delivered_version("ml/b") is None


def test_a_relist_delivers_and_forgets():
    api = WatchedApi(claim("a", 100), claim("b", 100))
    informer = Informer(api, "claims", threading.Event())
    informer.relist()
    informer.update(claim("a", 103))
    api.listed = [claim("a", 103)]  # b deleted meanwhile
    informer.relist()
    assert informer.delivered_version("ml/a") == 103
    assert informer.delivered_version("ml/b") is None


def test_an_informer_not_running_answers_at_once():
    """No watch runs (never started, or stopped): nothing would be delivered while waiting."""
    informer = Informer(WatchedApi(claim("a", 100)), "claims", threading.Event())
    informer.relist()
    informer.update(claim("a", 101))
    started = time.monotonic()
    assert not informer.wait_delivered(claim("a", 101), LONG_S)
    assert informer.wait_delivered(claim("a", 100), LONG_S)
    assert time.monotonic() - started < LONG_S / 2


def test_stopping_wakes_the_waiters(watched):
    _, informer = watched
    informer.update(claim("listed", 105))
    result: list[bool] = []
    waiter = threading.Thread(target=lambda: result.append(informer.wait_delivered(claim("listed", 105), LONG_S)))
    waiter.start()
    informer.stop()
    waiter.join(LONG_S)
    assert result == [False]
