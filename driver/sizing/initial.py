"""Automatic sizing of new claims, the webhook's Initial mode (pure: a claim made from a template and
its workload's recommendations in; a JSON patch, the original-request annotation and the user's
warnings out). docs/rightsizing.md, "Automatic sizing (Initial mode)".

Off by default. A claim is sized where its namespace carries the label `gpu.fgpu.dev/rightsize=initial`
(the platform team's) or the claim the annotation `gpu.fgpu.dev/rightsize: initial` (a template's
`spec.metadata.annotations` give it every claim made from it); `off` there pins the template, whatever
its namespace says. Only a share's capacity requests change (memory, and MPS compute): a change of
kind or MIG partition needs new selectors and moves the claim to another Kueue quota resource, so it
is left to `fgpu rightsize -o patch` and a person. Only a size the history decided (recommend.py:
not a pinned template, not a history too short), never below the observed memory peak, and during
an out-of-memory cool-down never below what the claim itself asks.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from driver.common.quantity import QuantityError, parse_quantity
from driver.sizing.history import HOUR_S
from driver.sizing.recommend import PIN_ANNOTATION, Policy, Recommendation, in_cooldown
from driver.sizing.sizes import KIND_OF_CLASS, Size

RIGHTSIZE = PIN_ANNOTATION  # the namespace's label and the claim's annotation: "initial" or "off"
INITIAL = "initial"
OFF = "off"
ORIGINAL_ANNOTATION = "gpu.fgpu.dev/rightsize-original"  # {request: its capacity.requests before}
SHARE_KINDS = frozenset({"mps", "timeslice", "mig-mps", "mig-timeslice"})
SHARE_QUOTA = "gpu.fgpu.dev/share-memory"  # what Kueue charges a share (docs/kueue.md)
MIB = 2**20

JsonObject = dict[str, Any]


def mode(annotations: Mapping[str, str], namespace_labels: Mapping[str, str]) -> str:
    """INITIAL or OFF: the claim's own annotation first (a pin wins over its namespace), then its
    namespace's label; anything else is off."""
    own = annotations.get(RIGHTSIZE)
    if own in (INITIAL, OFF):
        return own
    return INITIAL if namespace_labels.get(RIGHTSIZE) == INITIAL else OFF


@dataclass(frozen=True)
class RequestSizing:
    """One request of the claim, sized: its capacity requests before and after."""

    index: int
    name: str
    before: Mapping[str, str]  # capacity.requests as the claim asked ({}: the class's default)
    after: Mapping[str, str]
    recommendation: Recommendation


@dataclass(frozen=True)
class ClaimSizing:
    sized: tuple[RequestSizing, ...]
    skipped: tuple[str, ...]  # per request not sized, why (for the log)

    def patch(self, claim: JsonObject) -> list[JsonObject]:
        """The JSON patch (RFC 6902) setting the sized requests' capacity and the annotation with
        the original requests; no `test` operation, whose failure would refuse the claim."""
        if not self.sized:
            return []
        ops: list[JsonObject] = [
            {"op": "add", "path": f"/spec/devices/requests/{s.index}/exactly/capacity",
             "value": {"requests": dict(s.after)}}
            for s in self.sized
        ]  # fmt: skip
        original = json.dumps({s.name: dict(s.before) for s in self.sized}, sort_keys=True, separators=(",", ":"))
        if (claim.get("metadata") or {}).get("annotations"):
            ops.append(
                {"op": "add", "path": "/metadata/annotations/" + _pointer(ORIGINAL_ANNOTATION), "value": original}
            )
        else:
            ops.append({"op": "add", "path": "/metadata/annotations", "value": {ORIGINAL_ANNOTATION: original}})
        return ops

    def warnings(self) -> list[str]:
        """What the user sees at create (admission warnings): each change, and the quota it moves."""
        out = []
        for s in self.sized:
            rec, observed = s.recommendation, s.recommendation.observed
            out.append(
                f"gpu.fgpu.dev rightsize: request {s.name} sized {_text(s.before)} -> {_text(s.after)} "
                f"({rec.reason}: peak {observed.memory_peak_mib}Mi over {observed.span_s / HOUR_S:.0f} h); "
                f"the original is in annotation {ORIGINAL_ANNOTATION}"
            )
            if s.before.get("memory") != s.after.get("memory"):
                out.append(
                    f"gpu.fgpu.dev rightsize: request {s.name} now counts {s.after['memory']} of Kueue quota "
                    f"{SHARE_QUOTA}, not {s.before.get('memory', '1Gi (the class default)')}"
                )
        return out


def size_claim(
    claim: JsonObject, recommendations: Mapping[str, Recommendation], now: float, policy: Policy = Policy()
) -> ClaimSizing:
    """The claim's requests sized to their workload's recommendations (by request name), by the
    module's rules."""
    sized: list[RequestSizing] = []
    skipped: list[str] = []
    requests = ((claim.get("spec") or {}).get("devices") or {}).get("requests") or ()
    for index, request in enumerate(requests):
        name = str(request.get("name", ""))
        rec = recommendations.get(name)
        if rec is None:
            skipped.append(f"request {name}: no usage history")
            continue
        result = _size_request(index, name, request, rec, now, policy)
        if isinstance(result, str):
            skipped.append(f"request {name}: {result}")
        else:
            sized.append(result)
    return ClaimSizing(tuple(sized), tuple(skipped))


def _size_request(
    index: int, name: str, request: JsonObject, rec: Recommendation, now: float, policy: Policy
) -> RequestSizing | str:
    """The request sized, or why not."""
    exactly = request.get("exactly")
    if not isinstance(exactly, dict):
        return "not an `exactly` request (firstAvailable is not sized)"
    kind = KIND_OF_CLASS.get(str(exactly.get("deviceClassName", "")))
    if kind not in SHARE_KINDS:
        return f"device class {exactly.get('deviceClassName')!r}: only shares are sized at create"
    if not rec.decided:
        return rec.reason
    target, current = rec.recommended, rec.current
    if (target.kind, target.profile) != (kind, current.profile) or current.kind != kind:
        return f"recommended {target.describe()}: another kind or partition, left to `fgpu rightsize -o patch`"
    before = {str(k): str(v) for k, v in ((exactly.get("capacity") or {}).get("requests") or {}).items()}
    try:
        memory, compute = _mib(before.get("memory")), _whole(before.get("compute"))
    except QuantityError as err:
        return f"capacity requests not understood: {err}"
    new_memory, new_compute = target.memory_mib, target.compute_percent
    if new_memory is None or new_memory < rec.observed.memory_peak_mib:
        return f"recommended {target.describe()} is below the observed peak {rec.observed.memory_peak_mib}Mi"
    if in_cooldown(rec.observed, now, policy):  # after an out-of-memory: raised, never shrunk
        new_memory = max(new_memory, memory or 0)
        new_compute = max(new_compute, compute or 0) if new_compute is not None else None
    after = dict(before) | {"memory": f"{new_memory}Mi"}
    if new_compute is not None:
        after["compute"] = str(new_compute)
    if (new_memory, new_compute if new_compute is not None else compute) == (memory, compute):
        return f"already the right size ({target.describe()})"
    return RequestSizing(index, name, before, after, rec)


def original_size(annotations: Mapping[str, str], request: str, size: Size) -> Size | None:
    """The request's size before automatic sizing (the ORIGINAL_ANNOTATION the webhook wrote), of
    the sized claim's kind and partition; None where it was not sized or the annotation cannot be
    read (it is the user's to edit)."""
    try:
        before = json.loads(annotations.get(ORIGINAL_ANNOTATION) or "{}").get(request)
        if not isinstance(before, dict):
            return None
        memory, compute = _mib(before.get("memory")), _whole(before.get("compute"))
    except (ValueError, AttributeError):  # QuantityError and JSONDecodeError are ValueErrors
        return None
    return Size(size.kind, memory if memory is not None else size.memory_mib, compute, size.profile)


def _mib(text: Any) -> int | None:
    return None if text is None else -(-parse_quantity(str(text)) // MIB)


def _whole(text: Any) -> int | None:
    return None if text is None else int(parse_quantity(str(text)))


def _text(requests: Mapping[str, str]) -> str:
    return " ".join(f"{key} {value}" for key, value in sorted(requests.items())) or "the class's default"


def _pointer(key: str) -> str:
    """A map key as a JSON Pointer token (RFC 6901)."""
    return key.replace("~", "~0").replace("/", "~1")
