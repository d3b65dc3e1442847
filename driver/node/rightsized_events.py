"""The Event of a claim that automatic sizing changed (docs/rightsizing.md, "Seeing what happened"):
a Normal Event `RightSized` on the ResourceClaim, written when the plugin prepares it.

The webhook sizes a claim at its create, before it has a name or uid to hang an Event on; it leaves
the requests as they were in the annotation `gpu.fgpu.dev/rightsize-original`. Prepare reads the
claim anyway, so the plugin writes the Event from that annotation and the claim's spec: each sized
request's capacity requests now and before, and its device class where sizing changed its kind.
The annotation is the claim's, which its namespace's users may edit: it is read bounded and typed,
and one it cannot read is a log line and no Event.

At most one Event per claim: its name comes from the claim's uid, so a second create (kubelet's
retry of a failed prepare, a prepare after an unprepare, the other instance during a rolling update,
a restart) is refused by the API server as existing, for as long as the Event lives (its TTL, an hour
by default). Written on a thread of its own, in order: prepare's answer never waits for the API
server, and a failed write is a log line, never a failed prepare.
"""

from __future__ import annotations

import contextlib
import json
import logging
import queue
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from driver.claims.refs import ClaimRef
from driver.common.quantity import parse_quantity
from driver.kube.client import JsonObject, KubeApi
from driver.kube.errors import ConflictError, KubeError
from driver.kube.events import object_event
from driver.node.background import BackgroundWorker
from driver.sizing.initial import ORIGINAL_ANNOTATION, ORIGINAL_FIELDS
from driver.sizing.request import pinned_profile

log = logging.getLogger(__name__)

EVENT_REASON = "RightSized"
# The webhook writes at most 32 requests (the API's limit per claim) of a few short quantities.
ANNOTATION_LIMIT = 8192
REQUESTS_LIMIT = 32
CAPACITIES_LIMIT = 8
VALUE_LIMIT = 64
SELECTORS_LIMIT = 32  # the API's limit per request
PROFILE_NAME = re.compile(r"[0-9a-z.+]{1,32}")  # 1g.10gb, 1g.10gb+me, 3g
CAPACITY_NAME = re.compile(r"[A-Za-z0-9][-A-Za-z0-9_./]{0,62}")  # a qualified name: nothing to break a line
CLASS_NAME = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")  # a DNS subdomain
QUEUE_LIMIT = 1024  # claims waiting for their Event; past it one is dropped, with a log line


@dataclass(frozen=True)
class RequestSize:
    """What a request asks, as the Event shows it: its device class where sizing changed it, and
    its capacity requests."""

    device_class: str  # "" where sizing kept the class
    capacities: Mapping[str, str]
    profile: str = ""  # the MIG profile its selectors pin, where sizing changed its class or partition

    def describe(self) -> str:
        shown = [f"class {self.device_class}"] if self.device_class else []
        shown += [f"profile {self.profile}"] if self.profile else []
        shown += [f"{key} {value}" for key, value in sorted(self.capacities.items())]
        return ", ".join(shown) or "the class's default"


@dataclass(frozen=True)
class SizedRequest:
    """A request automatic sizing changed: what it asks now and what its template asked."""

    name: str
    after: RequestSize
    before: RequestSize


def annotation(claim: JsonObject) -> str | None:
    """The claim's ORIGINAL_ANNOTATION, None where it has none."""
    value = ((claim.get("metadata") or {}).get("annotations") or {}).get(ORIGINAL_ANNOTATION)
    return None if value is None else str(value)


def sized_requests(claim: JsonObject) -> tuple[SizedRequest, ...]:
    """The requests the annotation names, in the claim's order; ValueError saying why where the
    annotation is not what the webhook writes."""
    text = annotation(claim) or ""
    if len(text) > ANNOTATION_LIMIT:
        raise ValueError(f"longer than {ANNOTATION_LIMIT} characters")
    try:
        original = json.loads(text)
    except RecursionError:  # nested deeper than the parser goes: not ours either
        raise ValueError("nested too deep") from None
    if not isinstance(original, dict) or not 0 < len(original) <= REQUESTS_LIMIT:
        raise ValueError(f"not an object of 1 to {REQUESTS_LIMIT} requests")
    requests = {str(r.get("name")): r for r in _requests(claim)}
    unknown = sorted(set(original) - set(requests))
    if unknown:
        raise ValueError(f"names request {unknown[0][:VALUE_LIMIT]!r}, which the claim does not have")
    sized = []
    for name, request in requests.items():
        if name in original:
            before = _original(original[name], f"request {name}")
            sized.append(SizedRequest(name, _current(request, kind_changed=bool(before.device_class)), before))
    return tuple(sized)


def _requests(claim: JsonObject) -> list[JsonObject]:
    requests = ((claim.get("spec") or {}).get("devices") or {}).get("requests") or []
    return [r for r in requests if isinstance(r, dict)] if isinstance(requests, list) else []


def _original(entry: Any, where: str) -> RequestSize:
    """A request's entry in the annotation: its capacity requests, or where sizing changed its kind
    or partition, its ORIGINAL_FIELDS."""
    if not (isinstance(entry, dict) and "deviceClassName" in entry):
        return RequestSize("", _capacities(entry, where))
    unknown = sorted(set(entry) - set(ORIGINAL_FIELDS))
    if unknown:
        raise ValueError(f"{where}: {unknown[0][:VALUE_LIMIT]!r} is not a field sizing keeps")
    device_class = entry["deviceClassName"]
    if not isinstance(device_class, str) or not CLASS_NAME.fullmatch(device_class):
        raise ValueError(f"{where}: deviceClassName is not a class name")
    capacity = entry.get("capacity") or {}
    if not isinstance(capacity, dict):
        raise ValueError(f"{where}: capacity is not an object")
    return RequestSize(device_class, _capacities(capacity.get("requests") or {}, where), _profile(entry, where))


def _current(request: JsonObject, kind_changed: bool) -> RequestSize:
    """What the claim's request asks now (its class too where sizing changed it)."""
    exactly = request.get("exactly")
    where = f"the claim's request {request.get('name')}"
    if not isinstance(exactly, dict):
        raise ValueError(f"{where} is not an `exactly` request, which sizing changes")
    capacities = _capacities((exactly.get("capacity") or {}).get("requests") or {}, where)
    if not kind_changed:
        return RequestSize("", capacities)
    return RequestSize(str(exactly.get("deviceClassName", "")), capacities, _profile(exactly, where))


def _profile(exactly: Mapping[str, Any], where: str) -> str:
    """The MIG profile the request's selectors pin ("" where none does), checked: a few selectors,
    a profile name."""
    selectors = exactly.get("selectors") or []
    if not isinstance(selectors, list) or len(selectors) > SELECTORS_LIMIT:
        raise ValueError(f"{where}: selectors is not a list of at most {SELECTORS_LIMIT}")
    profile = pinned_profile({"selectors": [s for s in selectors if isinstance(s, dict)]}) or ""
    if profile and not PROFILE_NAME.fullmatch(profile):
        raise ValueError(f"{where}: {profile[:VALUE_LIMIT]!r} is not a MIG profile name")
    return profile


def _capacities(value: Any, where: str) -> dict[str, str]:
    """Capacity requests ({name: quantity}) checked: few, named plainly, each a quantity."""
    if not isinstance(value, dict) or len(value) > CAPACITIES_LIMIT:
        raise ValueError(f"{where}: not an object of at most {CAPACITIES_LIMIT} capacities")
    for key, quantity in value.items():
        if not CAPACITY_NAME.fullmatch(key):
            raise ValueError(f"{where}: {key[:VALUE_LIMIT]!r} is not a capacity name")
        if not isinstance(quantity, str) or len(quantity) > VALUE_LIMIT:
            raise ValueError(f"{where}: {key} is not a quantity of at most {VALUE_LIMIT} characters")
        parse_quantity(quantity)  # QuantityError, a ValueError, names the bad text
    return dict(value)


def rightsized_message(sized: tuple[SizedRequest, ...]) -> str:
    changes = "; ".join(f"request {s.name} sized to {s.after.describe()} from {s.before.describe()}" for s in sized)
    return f"{changes} by its workload's usage history ({ORIGINAL_ANNOTATION})"


def event_name(uid: str) -> str:
    """The claim's one RightSized Event: a second create of it is refused (409 AlreadyExists)."""
    return f"{uid}.rightsized"


def rightsized_event(claim: JsonObject, sized: tuple[SizedRequest, ...], reporter: str, now: datetime) -> JsonObject:
    """The Normal Event on the claim (as read at its prepare), named after its uid."""
    meta = claim["metadata"]
    involved = {key: meta.get(key) for key in ("name", "namespace", "uid", "resourceVersion")}
    message = rightsized_message(sized)
    event = object_event(
        "resource.k8s.io/v1", "ResourceClaim", involved, EVENT_REASON, message, reporter, now, warning=False
    )
    event["metadata"] = {"name": event_name(str(meta["uid"])), "namespace": meta["namespace"]}
    return event


def _utc_now() -> datetime:
    return datetime.now(UTC)


class RightsizedEvents(BackgroundWorker):
    """`prepared(ref, claim)` from prepare; the Events are written on this worker's thread."""

    thread_name = "rightsized-events"

    def __init__(self, api: KubeApi, reporter: str, clock: Callable[[], datetime] = _utc_now) -> None:
        super().__init__()
        self._api = api
        self._reporter = reporter
        self._clock = clock
        self._queue: queue.Queue[tuple[ClaimRef, JsonObject] | None] = queue.Queue(QUEUE_LIMIT)

    def prepared(self, ref: ClaimRef, claim: JsonObject) -> None:
        """A claim just prepared, as read for its prepare: its Event queued where it was sized.
        Never waits, never raises."""
        if annotation(claim) is None:
            return
        try:
            self._queue.put_nowait((ref, claim))
        except queue.Full:
            log.warning(
                "claim %s: %d claims wait for their %s event already; none for it", ref, QUEUE_LIMIT, EVENT_REASON
            )

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        with contextlib.suppress(queue.Full):  # a full queue: the worker sees the stop after its write
            self._queue.put_nowait(None)
        super().stop(timeout_s)

    def _run(self) -> None:
        while not self._stop.is_set():
            item = self._queue.get()
            if item is None:
                return
            try:
                self.record(*item)
            except Exception:
                log.exception("claim %s: writing its %s event failed", item[0], EVENT_REASON)

    def record(self, ref: ClaimRef, claim: JsonObject) -> None:
        """Write the claim's Event unless it exists; a failure is one log line."""
        try:
            sized = sized_requests(claim)
        except ValueError as err:
            log.warning(
                "claim %s: annotation %s not understood, no %s event: %s", ref, ORIGINAL_ANNOTATION, EVENT_REASON, err
            )
            return
        try:
            self._api.create_event(ref.namespace, rightsized_event(claim, sized, self._reporter, self._clock()))
        except ConflictError:
            return  # written already: by an earlier prepare of the claim, or the other plugin instance
        except KubeError as err:
            log.warning("claim %s: cannot record its %s event: %s", ref, EVENT_REASON, err)
