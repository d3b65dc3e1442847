"""List + watch caches: one thread per kind keeps a dict of objects current and wakes the controller."""

from __future__ import annotations

import logging
import threading
from typing import Any

from driver.kube import KubeError

log = logging.getLogger(__name__)
WATCH_TIMEOUT_S = 300


def object_key(obj: dict[str, Any]) -> str:
    meta = obj.get("metadata") or {}
    return f"{meta.get('namespace', '')}/{meta.get('name', '')}"


class Informer:
    def __init__(
        self, api: Any, kind: str, changed: threading.Event, label_selector: str = "", namespace: str = ""
    ) -> None:
        self.api, self.kind, self.changed, self.label_selector = api, kind, changed, label_selector
        self.namespace = namespace
        self._objects: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()
        self.synced = threading.Event()
        self.version = 0  # bumped on every change: callers rebuild what depends on this kind
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"informer-{kind}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def items(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._objects.values())

    def get(self, key: str) -> dict[str, Any] | None:
        with self._lock:
            return self._objects.get(key)

    def update(self, obj: dict[str, Any]) -> None:
        """Our own write, applied at once so the next pass does not act on the stale object."""
        self._apply("MODIFIED", obj)

    def relist(self) -> None:
        """Read everything afresh from the API server (after a conflict: the cache was stale). An
        object the watch brought in after the list stays; one missing from the list is gone."""
        items, resource_version = self.api.list(self.kind, self.label_selector, self.namespace)
        listed = {object_key(o): o for o in items}
        with self._lock:
            for key, current in list(self._objects.items()):
                if key not in listed and not _newer(current, {"metadata": {"resourceVersion": resource_version}}):
                    del self._objects[key]
            for key, obj in listed.items():
                current = self._objects.get(key)
                if current is None or not _newer(current, obj):
                    self._objects[key] = obj
            self.version += 1
        self.changed.set()

    def _apply(self, kind: str, obj: dict[str, Any]) -> None:
        key = object_key(obj)
        with self._lock:
            if kind == "DELETED":
                self._objects.pop(key, None)
            else:
                current = self._objects.get(key)
                if current is not None and _newer(current, obj):
                    return
                self._objects[key] = obj
            self.version += 1
        self.changed.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                items, resource_version = self.api.list(self.kind, self.label_selector, self.namespace)
                with self._lock:
                    self._objects = {object_key(o): o for o in items}
                    self.version += 1
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
                            self._apply(event_type, obj)
            except KubeError as error:
                if self._stop.is_set():
                    return
                log.warning("%s informer: %s; listing again", self.kind, error)
                self._stop.wait(1.0)


def _newer(current: dict[str, Any], incoming: dict[str, Any]) -> bool:
    """Whether our cached copy is newer than the incoming one (resourceVersions are integers in practice)."""
    try:
        return int(current["metadata"]["resourceVersion"]) > int(incoming["metadata"]["resourceVersion"])
    except (KeyError, ValueError):
        return False
