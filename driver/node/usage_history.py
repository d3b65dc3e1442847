"""The node plugin's usage history (docs/rightsizing.md): each sample's claims (driver/node/metrics.py's
sampling point, claim_usage.py's measures) kept at the sampling period, folded every write interval
into the history of the claims this plugin prepared (driver/sizing/history.py), and written to this
node's ConfigMap, `fgpu-usage-<node>` in the driver's namespace (driver/sizing/store.py); read back
at start, so that a restart keeps the week.

Whose a claim is: its pods' workload and the template it came from (driver/sizing/owner.py), from
one GET of the first pod that holds it (status.reservedFor, as the metrics read it), once per claim:
the owner of a pod does not change. A claim without a pod yet, or not made from a template, is
not recorded (nothing to patch); its samples wait for the next write while the API server cannot
be reached.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from driver.kube.client import KubeApi
from driver.kube.errors import KubeError, NotFoundError
from driver.node.background import BackgroundWorker
from driver.node.claim_usage import ClaimObservation
from driver.sizing import store
from driver.sizing.history import (
    DEFAULT_SAMPLE_S,
    ClaimRecord,
    HistoryError,
    Sample,
    UsageHistory,
    expire,
    merge,
    record,
)
from driver.sizing.initial import original_size
from driver.sizing.owner import request_index, template_of, workload_of
from driver.sizing.recommend import PIN_ANNOTATION

log = logging.getLogger(__name__)

WRITE_S = 300.0  # a lost plugin loses at most this much of the week
MAX_PENDING = 100_000  # samples between writes (a thousand claims for 16 min at 10 s; ~10 MB)
SAMPLE_SLACK = 0.9  # a sample this close to the period after the last one is taken (timer jitter)


@dataclass(frozen=True)
class HistorySettings:
    node: str
    namespace: str
    sample_s: float = DEFAULT_SAMPLE_S  # how often a sample is taken; each counts DEFAULT_SAMPLE_S
    write_s: float = WRITE_S


class _NoRecord(Exception):
    """A claim that is not recorded (yet), with the reason."""


class UsageRecorder(BackgroundWorker):
    """Keeps this node's usage history and writes it to its ConfigMap every `write_s` and at stop."""

    thread_name = "usage-history"

    def __init__(self, api: KubeApi, settings: HistorySettings, clock: Callable[[], float] = time.time) -> None:
        super().__init__()
        self._api = api
        self._settings = settings
        self._clock = clock  # the history's wall clock (a test hook may shift it)
        self._lock = threading.Lock()
        self._history = UsageHistory()
        self._pending: list[Sample] = []
        self._latest: dict[str, ClaimObservation] = {}  # each sampled claim's last observation: whose it is
        self._last_sample: float | None = None
        self._records: dict[str, ClaimRecord] = {}
        self._unrecorded: set[str] = set()  # claims known not to be sized: not asked again
        self._loaded = False

    @property
    def history(self) -> UsageHistory:
        with self._lock:
            return self._history

    def load(self) -> bool:
        """The history as last written (a restart keeps the week), merged into what this instance
        has; none, or unreadable: a new one. False while the API server cannot say: nothing is
        written until it has (a write would replace the week)."""
        try:
            stored = self._api.get_configmap(self._settings.namespace, store.configmap_name(self._settings.node))
            loaded = store.history_of(stored)
        except NotFoundError:
            loaded = None
        except HistoryError as err:
            log.warning("usage history: cannot read it back, starting a new one: %s", err)
            loaded = None
        except KubeError as err:
            log.info("usage history: cannot read it back yet: %s", err)
            return False
        with self._lock:
            self._loaded = True
            if loaded is not None:
                self._history = loaded if not self._history.claims else merge(loaded, self._history)
        log.info("usage history: %d claims read back", len(loaded.claims) if loaded else 0)
        return True

    def observe(self, now: float, observed: list[ClaimObservation]) -> None:
        """One sample's claims (metrics.py's sampling point): kept where a period has passed since
        the last one kept, so that each sample stands for the same time."""
        now = self._clock()  # the history's clock, not the caller's
        with self._lock:
            if self._last_sample is not None and now - self._last_sample < SAMPLE_SLACK * self._settings.sample_s:
                return
            self._last_sample = now
            for o in observed:
                self._latest[o.claim_uid] = o
                self._pending.append(Sample(o.claim_uid, now, o.use.memory_mib, o.use.compute_percent,
                                            o.use.at_memory_limit))  # fmt: skip
            del self._pending[:-MAX_PENDING]

    def flush(self) -> None:
        """Fold the pending samples into the history, expire it, and write it (once read back)."""
        if not self._loaded and not self.load():
            return
        with self._lock:
            pending, self._pending = self._pending, []
            latest, self._latest = self._latest, {}
        records: dict[str, ClaimRecord] = {}
        waiting: dict[str, ClaimObservation] = {}  # the API server did not answer: tried at the next write
        for uid, observation in latest.items():  # one lookup per claim, whatever its samples
            try:
                records[uid] = self._record(observation)
            except _NoRecord as why:
                log.debug("usage history: claim %s/%s not recorded: %s", observation.namespace, observation.name, why)
            except KubeError:
                waiting[uid] = observation
        kept = [sample for sample in pending if sample.claim_uid in records]
        with self._lock:
            self._pending[:0] = [sample for sample in pending if sample.claim_uid in waiting]
            self._latest = waiting | self._latest
            self._history = expire(record(self._history, records.values(), kept), self._clock())
            history = self._history
            live = set(history.claims) | set(self._latest)
        self._records = {uid: r for uid, r in self._records.items() if uid in live}  # claims come and go
        self._unrecorded &= live | set(latest)
        self._write(history)

    def _record(self, o: ClaimObservation) -> ClaimRecord:
        known = self._records.get(o.claim_uid)
        if known is not None and known.size == o.use.size:
            return known
        if o.claim_uid in self._unrecorded:
            raise _NoRecord("not made from a template")
        if not o.pods:
            raise _NoRecord("no pod holds it yet")
        name, uid = o.pods[0]
        try:
            pod = self._api.get_pod(o.namespace, name)
        except NotFoundError as err:
            raise _NoRecord(f"its pod {name} is gone") from err
        if (pod.get("metadata") or {}).get("uid") != uid:
            raise _NoRecord(f"its pod {name} was re-created")
        template = template_of(pod, dict(o.claim))
        if not template:
            self._unrecorded.add(o.claim_uid)
            raise _NoRecord("not made from a template")
        annotations = (o.claim.get("metadata") or {}).get("annotations") or {}
        made = ClaimRecord(
            uid=o.claim_uid,
            namespace=o.namespace,
            claim=o.name,
            workload=workload_of(pod),
            template=template,
            request=o.request,
            request_index=max(0, request_index(dict(o.claim), o.request)),
            gpu=o.gpu_product,
            size=o.use.size,
            pinned=annotations.get(PIN_ANNOTATION) == "off",
            # Sized at create (the webhook's Initial mode): after an out-of-memory, back to this.
            original=original_size(annotations, o.request, o.use.size, o.gpu_product),
        )
        self._records[o.claim_uid] = made
        return made

    def _write(self, history: UsageHistory) -> None:
        namespace, node = self._settings.namespace, self._settings.node
        try:
            body = store.configmap(node, namespace, history)
            try:
                self._api.replace_configmap(namespace, body["metadata"]["name"], body)
            except NotFoundError:
                self._api.create_configmap(namespace, body)
        except (KubeError, HistoryError) as err:  # the next write tries again; the history is kept
            log.warning("usage history: cannot write ConfigMap %s/%s: %s", namespace, store.configmap_name(node), err)

    def _run(self) -> None:
        self.load()
        while not self._stop.wait(self._settings.write_s):
            try:
                self.flush()
            except Exception:  # the next write tries again; the plugin goes on
                log.exception("usage history: write failed")

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop, with a last write: what was sampled since the last one is kept."""
        super().stop(timeout_s)
        try:
            self.flush()
        except Exception:
            log.exception("usage history: last write failed")


class Sampler(BackgroundWorker):
    """Takes a sample every period where no metrics server does (its port off)."""

    thread_name = "usage-sampler"

    def __init__(self, sample: Callable[[], object], period_s: float) -> None:
        super().__init__()
        self._sample = sample
        self._period_s = period_s

    def _run(self) -> None:
        while not self._stop.wait(self._period_s):
            try:
                self._sample()
            except Exception:  # the next sample tries again
                log.exception("usage sample failed")
