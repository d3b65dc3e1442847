"""Automatic sizing of new claims at create (POST /rightsize, `fgpu webhook --rightsize-history-namespace`):
a ResourceClaim that kube-controller-manager makes from a pod's template gets its workload's
recommended size (driver/sizing/initial.py: the opt-in, the rules and the patch), read from the
node plugins' usage histories.

Whose the claim is comes from its pod: the claim's controller owner, read once (its template is the
pod's `spec.resourceClaims` entry that the claim's `resource.kubernetes.io/pod-claim-name` names, its
workload the pod's owner: driver/sizing/owner.py). The recommendations are computed from every
node's ConfigMap, merged, at most once a minute (a burst of claims reads them once); the namespaces'
labels are kept as long. Never a refusal: a claim not opted in, without history, whose pod or
history cannot be read, or anything unexpected is admitted as it came, with a log line. The user
sees a change in the admission warnings and the claim's annotation; the claim has no name or uid yet
for an Event, so the node plugin writes it at prepare (driver/node/rightsized_events.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Generic, Protocol, TypeVar

from driver.admission.review import admission_request, allowed
from driver.common.flags import DEFAULT_DRIVER_NAME
from driver.sizing import store
from driver.sizing.initial import INITIAL, OFF, ORIGINAL_ANNOTATION, RIGHTSIZE, mode, size_claim
from driver.sizing.offers import Offers, offers_in
from driver.sizing.owner import POD_CLAIM_NAME, template_of, workload_of
from driver.sizing.recommend import Policy, Recommendation, WorkloadKey, recommend

LOG = logging.getLogger("fgpu.webhook")
TTL_S = 60.0  # the plugins write their histories every 5 minutes: a minute old is fresh enough
ERROR_TTL_S = 10.0  # an unreadable history is not asked for again sooner: a burst waits on nothing
MAX_NAMESPACES = 1024  # labels cached at most; then the cache starts over

JsonObject = dict[str, Any]
T = TypeVar("T")


class RightsizeApi(Protocol):
    """The reads of automatic sizing; None when the object does not exist, KubeError when it
    cannot be read."""

    def read_pod(self, namespace: str, name: str) -> JsonObject | None: ...
    def read_namespace(self, name: str) -> JsonObject | None: ...
    def list_usage_histories(self, namespace: str) -> list[JsonObject]: ...
    def list_driver_slices(self, driver: str) -> list[JsonObject]: ...


class _Cached(Generic[T]):
    """One read's result, kept TTL_S (a failure ERROR_TTL_S, raised again meanwhile); the caller
    holds the lock, so the others of a burst wait for its result."""

    def __init__(self) -> None:
        self._value: tuple[float, T | Exception] | None = None

    def get(self, now: float, read: Callable[[], T]) -> T:
        cached = self._value
        if cached is None or now - cached[0] >= (ERROR_TTL_S if isinstance(cached[1], Exception) else TTL_S):
            try:
                value: T | Exception = read()
            except Exception as err:  # KubeError, HistoryError, ...: the claim is admitted as it came
                value = err
            self._value = cached = (now, value)
        if isinstance(cached[1], Exception):
            raise cached[1]
        return cached[1]


class Rightsizer:
    """The recommendations, the offers and the namespace labels, each cached for TTL_S (a failed
    read for ERROR_TTL_S)."""

    def __init__(
        self, api: RightsizeApi, history_namespace: str, policy: Policy = Policy(),
        clock: Callable[[], float] = time.time, driver: str = DEFAULT_DRIVER_NAME,
    ) -> None:  # fmt: skip
        self.api = api
        self.policy = policy
        self.clock = clock
        self._history_namespace = history_namespace
        self._driver = driver
        self._lock = threading.Lock()  # one read at a time: the others of a burst wait for its result
        self._recommendations: _Cached[Mapping[WorkloadKey, Recommendation]] = _Cached()
        self._offers: _Cached[Offers] = _Cached()
        self._labels: dict[str, tuple[float, Mapping[str, str]]] = {}

    def recommendations(self) -> Mapping[WorkloadKey, Recommendation]:
        with self._lock:
            now = self.clock()
            return self._recommendations.get(now, lambda: self._recommend(now))

    def _recommend(self, now: float) -> Mapping[WorkloadKey, Recommendation]:
        history = store.merged(self.api.list_usage_histories(self._history_namespace))
        return {rec.key: rec for rec in recommend(history, now, self.policy)}

    def offers(self) -> Offers:
        """What the driver's ResourceSlices publish; unread (nothing offered, the reason kept) where
        they cannot be read: then only shares are sized."""
        with self._lock:
            try:
                return self._offers.get(self.clock(), lambda: offers_in(self.api.list_driver_slices(self._driver)))
            except Exception as err:  # KubeError, ...
                return Offers(unread=f"ResourceSlices of {self._driver} not read: {err}")

    def namespace_labels(self, name: str) -> Mapping[str, str]:
        with self._lock:
            now = self.clock()
            cached = self._labels.get(name)
            if cached is not None and now - cached[0] < TTL_S:
                return cached[1]
        namespace = self.api.read_namespace(name) or {}
        labels = dict((namespace.get("metadata") or {}).get("labels") or {})
        with self._lock:
            if len(self._labels) >= MAX_NAMESPACES:
                self._labels.clear()
            self._labels[name] = (now, labels)
        return labels


def rightsize(document: Any, sizer: Rightsizer) -> dict[str, Any]:
    """The AdmissionReview answering a claim's CREATE: allowed, with the sizing patch and warnings
    where it opts in and its workload's history decides a new size."""
    request = admission_request(document)
    claim = request.get("object")
    kind = (request.get("kind") or {}).get("kind", "")
    if kind != "ResourceClaim" or request.get("operation") != "CREATE" or not isinstance(claim, dict):
        return allowed(request)
    metadata = claim.get("metadata") or {}
    annotations = metadata.get("annotations") or {}
    namespace = str(request.get("namespace") or metadata.get("namespace") or "")
    name = f"{namespace}/{metadata.get('name') or str(metadata.get('generateName', '')) + '*'}"
    if not annotations.get(POD_CLAIM_NAME) or ORIGINAL_ANNOTATION in annotations:
        return allowed(request)  # not made from a template, or sized already (a reinvocation)
    try:
        patch, warnings = _sized(claim, namespace, annotations, sizer)
    except Exception as err:  # never a refusal for our own failure: the claim keeps its template's size
        LOG.warning("claim %s admitted unsized: %s", name, err)
        return allowed(request)
    if patch:
        LOG.info("claim %s sized: %s", name, "; ".join(warnings))
    return allowed(request, patch, warnings)


def _sized(
    claim: JsonObject, namespace: str, annotations: Mapping[str, str], sizer: Rightsizer
) -> tuple[list[JsonObject], list[str]]:
    # The claim's own annotation decides first; only without one is its namespace read.
    labels = {} if annotations.get(RIGHTSIZE) in (INITIAL, OFF) else sizer.namespace_labels(namespace)
    if mode(annotations, labels) != INITIAL:
        return [], []
    pod = _pod(claim, namespace, sizer)
    template = template_of(pod, claim)
    if not template:
        raise ValueError("its pod names no template for it")
    workload = workload_of(pod)
    recommendations = sizer.recommendations()
    by_request = {
        str(r.get("name", "")): rec
        for r in ((claim.get("spec") or {}).get("devices") or {}).get("requests") or ()
        if (rec := recommendations.get(WorkloadKey(namespace, workload, template, str(r.get("name", ""))))) is not None
    }
    sizing = size_claim(claim, by_request, sizer.clock(), sizer.policy, sizer.offers())
    if sizing.skipped:
        LOG.info("claim of %s %s/%s (template %s) not sized: %s", workload.kind, namespace, workload.name, template,
                 "; ".join(sizing.skipped))  # fmt: skip
    return sizing.patch(claim), sizing.warnings()


def _pod(claim: JsonObject, namespace: str, sizer: Rightsizer) -> JsonObject:
    """The pod the claim was made for (its controller owner), as it is now."""
    owners = (claim.get("metadata") or {}).get("ownerReferences") or ()
    owner = next((o for o in owners if o.get("kind") == "Pod" and o.get("controller")), None)
    if owner is None:
        raise ValueError("no Pod owns it")
    pod = sizer.api.read_pod(namespace, str(owner.get("name", "")))
    if pod is None or (pod.get("metadata") or {}).get("uid") != owner.get("uid"):
        raise ValueError(f"its pod {owner.get('name')} is gone")
    return pod
