"""List + watch caches: one thread per kind keeps a dict of objects current and wakes the controller.

The list is read in pages (limit + continue), and an informer may keep each object in a form of
its own (`transform`): the slices are parsed as their pages arrive and only the parsed form is
kept, so 25,000 slices never sit in memory twice, nor all at once as API objects."""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from driver.kube.errors import KubeError, NotFoundError, RefusedError

log = logging.getLogger(__name__)
WATCH_TIMEOUT_S = 300
LIST_PAGE_SIZE = 500  # as client-go's reflector: bounded responses, and memory, at any cluster size
ABSENT_RETRY_S = 60.0  # how often an optional kind the API server does not serve is listed again

Transform = Callable[[dict[str, Any]], Any]  # the API object -> what is kept (None: nothing is)


def object_key(obj: dict[str, Any]) -> str:
    meta = obj.get("metadata") or {}
    return f"{meta.get('namespace', '')}/{meta.get('name', '')}"


def _identity(obj: dict[str, Any]) -> dict[str, Any]:
    return obj


class Informer:
    def __init__(
        self,
        api: Any,
        kind: str,
        changed: threading.Event,
        label_selector: str = "",
        namespace: str = "",
        transform: Transform = _identity,
        long_lived: bool = False,
        optional: bool = False,
    ) -> None:
        """`long_lived`: what is kept lives as long as the process (the parsed slices, millions of
        objects at 5,000 nodes): each listed page is moved out of the cyclic GC's way (gc.freeze),
        which would otherwise scan the growing heap again and again while the list is read (4 of
        10 s at 1,000 nodes). What is freed later is freed all the same (by reference counts: the
        parsed slices hold no cycles).

        `optional`: a kind a cluster may not serve (an API behind a feature gate) or this replica
        may not be allowed to read: a list the API server refuses (not found, forbidden) counts as
        synced with nothing in it, and is tried again every ABSENT_RETRY_S."""
        self.api, self.kind, self.changed, self.label_selector = api, kind, changed, label_selector
        self.namespace, self.transform, self.long_lived = namespace, transform, long_lived
        self.optional = optional
        self.absent: str | None = None  # why an optional kind is not there (None: it is listed)
        self._objects: dict[str, tuple[int | None, Any]] = {}  # key -> (resourceVersion, kept form)
        # key -> the newest resourceVersion the API server sent us (list, watch), our own writes aside:
        # what other watchers of the API server (kube-scheduler) have very likely seen too
        self._delivered: dict[str, int] = {}
        self._lock = threading.Lock()
        self._delivery = threading.Condition(self._lock)  # notified on each delivery, and on stop
        self.synced = threading.Event()
        self.sync_seconds: float | None = None  # from start() to the end of the first list
        self._started = 0.0
        self.version = 0  # bumped on every change: callers rebuild what depends on this kind
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"informer-{kind}", daemon=True)

    def start(self) -> None:
        self._started = time.monotonic()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        with self._delivery:
            self._delivery.notify_all()  # waiters return: nothing is delivered any more

    def items(self) -> list[Any]:
        with self._lock:
            return [kept for _, kept in self._objects.values()]

    def get(self, key: str) -> Any:
        with self._lock:
            entry = self._objects.get(key)
        return None if entry is None else entry[1]

    def update(self, obj: dict[str, Any]) -> None:
        """Our own write, applied at once so the next pass does not act on the stale object. It
        does not count as delivered (wait_delivered): other watchers have not seen it yet."""
        self._apply("MODIFIED", obj, delivered=False)

    def forget(self, obj: dict[str, Any]) -> None:
        """Our own delete, applied at once."""
        self._apply("DELETED", obj, delivered=False)

    def wait_delivered(self, obj: dict[str, Any], timeout_s: float) -> bool:
        """Wait, at most `timeout_s`, until the API server delivered (list or watch) `obj` at its
        resourceVersion or a newer one; whether it did. Ends early when the informer stops; one that
        is not running has no watch to wait for: it answers at once."""
        key, version = object_key(obj), _version(obj)
        if version is None:
            return True  # nothing to compare: no version to wait for

        def settled() -> bool:
            return self._delivered.get(key, -1) >= version or self._stop.is_set()

        with self._delivery:
            self._delivery.wait_for(settled, timeout_s if self._thread.is_alive() else 0.0)
            return self._delivered.get(key, -1) >= version

    def delivered_version(self, key: str) -> int | None:
        """The newest resourceVersion of `key` the API server delivered, None if none is held."""
        with self._lock:
            return self._delivered.get(key)

    def _note_delivered(self, key: str, version: int | None) -> None:
        """The API server sent `key` at `version`: remembered if newer (lock held; callers wake the waiters)."""
        if version is not None and version > self._delivered.get(key, -1):
            self._delivered[key] = version

    def _forget_delivered_of_gone(self) -> None:
        """Forget what was delivered of objects no longer held (lock held): memory follows the cache."""
        for key in self._delivered.keys() - self._objects.keys():
            del self._delivered[key]
        self._delivery.notify_all()

    def _list(self) -> tuple[dict[str, tuple[int | None, Any]], str]:
        """Everything, page by page (each page transformed before the next is read). An object we
        hold at the same version keeps its kept form: a list again after a watch error re-parses
        only what changed, and callers see only that as changed (by identity)."""
        with self._lock:
            held = dict(self._objects)
        listed: dict[str, tuple[int | None, Any]] = {}
        resource_version = ""
        for items, page_version in self.api.list_pages(self.kind, self.label_selector, self.namespace, LIST_PAGE_SIZE):
            resource_version = page_version  # every page carries the list's
            for obj in items:
                key, version = object_key(obj), _version(obj)
                current = held.get(key)
                if current is not None and version is not None and current[0] == version:
                    listed[key] = current
                elif (kept := self.transform(obj)) is not None:
                    listed[key] = (version, kept)
            if self.long_lived:
                gc.freeze()
        return listed, resource_version

    def relist(self) -> None:
        """Read everything afresh from the API server (after a conflict: the cache was stale). An
        object the watch brought in after the list stays; one missing from the list is gone."""
        listed, resource_version = self._list()
        list_version = _version({"metadata": {"resourceVersion": resource_version}})
        with self._lock:
            for key, (version, _) in list(self._objects.items()):
                if key not in listed and not _newer(version, list_version):
                    del self._objects[key]
            for key, (version, kept) in listed.items():
                current = self._objects.get(key)
                if current is None or not _newer(current[0], version):
                    self._objects[key] = (version, kept)
                self._note_delivered(key, version)
            self._forget_delivered_of_gone()
            self.version += 1
        self.changed.set()

    def _apply(self, kind: str, obj: dict[str, Any], delivered: bool) -> None:
        """An event: from the watch (`delivered`), or our own write or delete."""
        key, version = object_key(obj), _version(obj)
        with self._lock:
            current = self._objects.get(key)
            if kind != "DELETED" and current is not None and _newer(current[0], version):
                if delivered:
                    self._note_delivered(key, version)  # older than our own write, yet on its way
                    self._delivery.notify_all()
                return
        kept = None if kind == "DELETED" else self.transform(obj)  # outside the lock: parsing takes time
        with self._lock:
            if kept is None:  # deleted, or no longer readable: gone for the callers
                self._objects.pop(key, None)
                self._delivered.pop(key, None)
            else:
                self._objects[key] = (version, kept)
                if delivered:
                    self._note_delivered(key, version)
            self._delivery.notify_all()
            self.version += 1
        self.changed.set()

    def _absent_now(self, error: KubeError) -> None:
        """An optional kind the API server does not serve (or lets us read): synced, and empty."""
        if self.absent != str(error):
            log.warning("%s: cannot be listed (%s); none, listed again every %.0f s", self.kind, error, ABSENT_RETRY_S)
        self.absent = str(error)
        with self._lock:
            if self._objects:
                self._objects = {}
                self._forget_delivered_of_gone()
                self.version += 1
        if self.sync_seconds is None:
            self.sync_seconds = time.monotonic() - self._started
        self.synced.set()
        self.changed.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                try:
                    listed, resource_version = self._list()
                except (NotFoundError, RefusedError) as error:
                    if not self.optional:
                        raise
                    self._absent_now(error)
                    self._stop.wait(ABSENT_RETRY_S)
                    continue
                self.absent = None
                with self._lock:
                    self._objects = listed
                    self._delivered = {key: version for key, (version, _) in listed.items() if version is not None}
                    self._delivery.notify_all()
                    self.version += 1
                if self.sync_seconds is None:
                    self.sync_seconds = time.monotonic() - self._started
                    log.info("%s: %d listed in %.1f s", self.kind, len(listed), self.sync_seconds)
                self.synced.set()
                self.changed.set()
                while not self._stop.is_set():
                    for event_type, obj in self.api.watch(
                        self.kind, resource_version, WATCH_TIMEOUT_S, self.label_selector, self.namespace
                    ):
                        if event_type == "ERROR":
                            raise KubeError(f"watch of {self.kind} ended: {obj.get('message')}")
                        resource_version = obj["metadata"].get("resourceVersion", resource_version)
                        if event_type != "BOOKMARK":
                            self._apply(event_type, obj, delivered=True)
            except KubeError as error:
                if self._stop.is_set():
                    return
                log.warning("%s informer: %s; listing again", self.kind, error)
                self._stop.wait(1.0)


def _version(obj: dict[str, Any]) -> int | None:
    """An object's resourceVersion as a number (integers in practice), None when it has none."""
    try:
        return int(obj["metadata"]["resourceVersion"])
    except (KeyError, ValueError, TypeError):
        return None


def _newer(current: int | None, incoming: int | None) -> bool:
    """Whether our cached copy is newer than the incoming one (unknown versions never are)."""
    return current is not None and incoming is not None and current > incoming
