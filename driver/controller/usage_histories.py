"""The usage histories of nodes that are gone: each node plugin keeps the history of the claims it
prepared in a ConfigMap of its own (driver/sizing/store.py), which stays when an autoscaler removes
the node, so that the workloads that ran there are still sized by it for the week it covers. Once
nothing in it counts any more (every bucket past the retention: history.expire), the leader deletes
it, as read (uid and resourceVersion preconditions: a plugin that wrote it since keeps it), so a
fleet that grows and shrinks does not keep a ConfigMap for every node it ever had. Looked at once
an hour: one paged LIST of the namespace's histories; only those of nodes that are gone are read."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from driver.controller.api import ControllerApi
from driver.controller.clock import WallClock, monotonic
from driver.kube.errors import KubeError, NotFoundError
from driver.kube.informer import Informer
from driver.sizing import store
from driver.sizing.history import HistoryError, expire

log = logging.getLogger(__name__)
SWEEP_EVERY_S = 3600.0


class HistorySweeper:
    def __init__(
        self,
        api: ControllerApi,
        namespace: str,
        nodes: Informer,
        wall_clock: WallClock,
        clock: Callable[[], float] = monotonic,
    ) -> None:
        self._api, self._namespace, self._nodes = api, namespace, nodes
        self._wall_clock, self._clock = wall_clock, clock
        self._last: float | None = None  # when it last looked (monotonic)

    def sweep(self) -> int:
        """Delete the expired histories of nodes that are gone, at most once an hour; how many went."""
        now = self._clock()
        if self._last is not None and now - self._last < SWEEP_EVERY_S:
            return 0
        self._last = now
        selector = f"{store.COMPONENT_LABEL}={store.COMPONENT}"
        live = {store.configmap_name(obj["metadata"]["name"]) for obj in self._nodes.items()}
        deleted = 0
        try:  # page by page: a fleet's histories together are far larger than one page of them
            for page, _ in self._api.list_pages("configmaps", selector, self._namespace):
                for obj in page:
                    if store.is_usage_configmap(obj) and obj["metadata"]["name"] not in live and self._spent(obj):
                        deleted += self._delete(obj)
        except KubeError as error:
            log.warning("cannot list the usage histories: %s", error)
        return deleted

    def _spent(self, obj: dict[str, Any]) -> bool:
        """Whether nothing in the history counts any more (an unreadable one is left alone)."""
        try:
            history = store.history_of(obj)
        except HistoryError as error:
            log.warning("usage history %s: %s", obj["metadata"]["name"], error)
            return False
        return history is None or not expire(history, self._wall_clock.now().timestamp()).claims

    def _delete(self, obj: dict[str, Any]) -> int:
        name = obj["metadata"]["name"]
        try:
            self._api.delete_configmap(self._namespace, obj)
        except NotFoundError:
            return 0
        except KubeError as error:  # ConflictError included: written since
            log.info("keeping usage history %s: %s", name, error)
            return 0
        log.info("deleted usage history %s: its node is gone and its week is over", name)
        return 1
