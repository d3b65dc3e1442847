"""Publishes the node's pool as ResourceSlices and keeps it there.

Kubelet deletes all of a node's slices when it starts, and a user may delete or edit one; the
publisher watches its own slices and restores them within seconds. Changes bump the pool
generation, rewrite the slices in place and delete obsolete ones. An unreachable API server is
retried with backoff, never fatal.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import replace
from typing import Any

from driver.inventory.devices import DeviceTaint, Inventory
from driver.inventory.slices import SPEC_HASH_ANNOTATION, build_slices, node_owner
from driver.kube.client import KubeApi
from driver.kube.errors import KubeError, KubeUnavailableError, NotFoundError
from driver.node import metrics
from driver.node.background import BackgroundWorker

log = logging.getLogger(__name__)
RACE_RETRY_S = 0.2
MAX_BACKOFF_S = 30.0


class SlicePublisher(BackgroundWorker):
    thread_name = "slice-publisher"

    def __init__(self, api: KubeApi, driver: str, node: str, inventory: Inventory, resync_s: int = 60) -> None:
        self._api = api
        self._driver = driver
        self._node = node
        self._inventory = inventory
        self._resync_s = resync_s
        super().__init__()
        self._lock = threading.Lock()
        self._owner: dict[str, Any] | None = None
        self._generation = 0  # the highest pool generation this publisher wrote
        # Apart from the inventory, so that a new inventory keeps the taints in force.
        self._taints: dict[str, tuple[DeviceTaint, ...]] = {}

    def set_inventory(self, inventory: Inventory) -> None:
        """Publish these devices now (taints as set); kept from here on even when this write fails."""
        with self._lock:
            self._inventory = inventory
        self.reconcile()

    def set_taints(self, taints: dict[str, tuple[DeviceTaint, ...]]) -> None:
        """Publish these taints (device name -> taints; others none) now. The slices keep them
        from here on even when this write fails: the caller retries, and so does the watch loop."""
        with self._lock:
            self._taints = dict(taints)
        self.reconcile()

    def _desired(self, generation: int) -> list[dict[str, Any]]:
        devices = [replace(d, taints=self._taints.get(d.name, ())) for d in self._inventory.devices]
        inventory = replace(self._inventory, devices=devices)
        return build_slices(self._driver, self._node, inventory, generation, self._owner)

    def reconcile(self) -> str | None:
        """Make the API server hold exactly our slices. Returns the resourceVersion of a list that
        showed them up to date, or None after writing (the caller lists again before watching, so
        that a change made meanwhile is not missed)."""
        with self._lock:
            if self._owner is None:
                try:
                    self._owner = node_owner(self._api.get_node(self._node))
                except NotFoundError as err:  # kubelet registers the Node; wait for it, with backoff
                    raise KubeUnavailableError(f"Node {self._node} does not exist (yet)") from err
            existing, resource_version = self._api.list_slices(self._driver, self._node)
            self._generation = max([self._generation, *(s["spec"]["pool"]["generation"] for s in existing)])
            desired = self._desired(0)
            if self._up_to_date(existing, desired):
                return resource_version
            # Never go back, even when every slice was deleted: a consumer may still hold old ones.
            self._generation += 1
            generation = self._generation
            desired = self._desired(generation)
            by_name = {s["metadata"]["name"]: s for s in existing}
            for body in desired:
                name = body["metadata"]["name"]
                if name in by_name:
                    body["metadata"]["resourceVersion"] = by_name.pop(name)["metadata"]["resourceVersion"]
                    self._api.replace_slice(name, body)
                else:
                    self._api.create_slice(body)
            for name in by_name:
                self._api.delete_slice(name)
            log.info("published pool %s generation %d: %d slice(s)", self._node, generation, len(desired))
            return None

    @staticmethod
    def _up_to_date(existing: list[dict[str, Any]], desired: list[dict[str, Any]]) -> bool:
        if len(existing) != len(desired):
            return False
        want = {s["metadata"]["name"]: s["metadata"]["annotations"][SPEC_HASH_ANNOTATION] for s in desired}
        generations = {s["spec"]["pool"]["generation"] for s in existing}
        return len(generations) == 1 and all(
            want.get(s["metadata"]["name"]) == (s["metadata"].get("annotations") or {}).get(SPEC_HASH_ANNOTATION)
            for s in existing
        )

    def _run(self) -> None:
        backoff = 1.0
        while not self._stop.is_set():
            try:
                resource_version = self.reconcile()
                backoff = 1.0
                if resource_version is not None:
                    self._watch_until_change(resource_version)
                continue
            except KubeUnavailableError as err:
                log.warning("publishing ResourceSlices failed, retrying in %.0fs: %s", backoff, err)
                metrics.record_publish_failure("unavailable")
            except KubeError as err:
                # A slice deleted or changed under us (kubelet deleting them all, say): a race, not
                # an outage, so retry soon.
                log.info("publishing ResourceSlices raced with another writer (%s); retrying", err)
                metrics.record_publish_failure("conflict")
                backoff = min(backoff, RACE_RETRY_S)
            except Exception:
                log.exception("unexpected error publishing ResourceSlices; retrying in %.0fs", backoff)
                metrics.record_publish_failure("error")
            if self._stop.wait(backoff):
                return
            metrics.record_publish_retry()
            backoff = min(backoff * 2, MAX_BACKOFF_S)

    def _watch_until_change(self, resource_version: str) -> None:
        """Return as soon as our slices may differ from what we want, or after the resync period."""
        with self._lock:
            desired = self._desired(0)
        wanted = {s["metadata"]["name"]: s["metadata"]["annotations"][SPEC_HASH_ANNOTATION] for s in desired}
        for event_type, obj in self._api.watch_slices(self._driver, self._node, resource_version, self._resync_s):
            if self._stop.is_set():
                return
            name = obj.get("metadata", {}).get("name")
            annotations = obj.get("metadata", {}).get("annotations") or {}
            if event_type == "DELETED" or event_type == "ERROR":
                log.info("ResourceSlice %s %s; republishing", name, event_type.lower())
                return
            if wanted.get(name) != annotations.get(SPEC_HASH_ANNOTATION):
                log.info("ResourceSlice %s changed by someone else; republishing", name)
                return
