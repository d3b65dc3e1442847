"""Automatic sizing of new claims, the webhook's Initial mode (pure: a claim made from a template,
its workload's recommendations and the cluster's offers in; a JSON patch, the original-request
annotation and the user's warnings out). docs/rightsizing.md, "Automatic sizing (Initial mode)".

Off by default. A claim is sized where its namespace carries the label `gpu.fgpu.dev/rightsize=initial`
(the platform team's) or the claim the annotation `gpu.fgpu.dev/rightsize: initial` (a template's
`spec.metadata.annotations` give it every claim made from it); `off` there pins the template, whatever
its namespace says. Only a size the history decided (recommend.py: not a pinned template, not a
history too short), never below the observed memory peak, and during an out-of-memory cool-down
never below what the claim itself asks.

A share keeps its kind and gets new capacity requests. A change of kind or MIG partition (a whole
GPU to a MIG partition or an MPS share, a partition to a smaller profile) also sets the device class
and replaces the selectors with the one that pins the new size (request.py, as `fgpu rightsize -o
patch` does for templates), and is made only where it is plainly the same request, smaller:
- some node publishes that kind and partition for the GPU product the usage was seen on (offers.py);
- the request asks for one device (`count` 1, allocationMode ExactCount): n partitions or shares are
  not n GPUs (a share of one GPU may be placed next to another share of it);
- no admin access, and no constraint or config of the claim names the request (or all requests): a
  matchAttribute or an opaque config written for one kind need not hold for another;
- its selectors read nothing of a device but its product and its sizes (SIZING_FIELDS): the new
  size's selector replaces them, so anything else they ask (a capability, a driver) would be lost.
Otherwise it is skipped, with the reason in the log. The warnings name the Kueue quota resource the
claim now counts against where it moves to another one (docs/kueue.md).

The annotation ORIGINAL_ANNOTATION holds per sized request what it asked: its capacity requests
where only they changed (the format the node plugin's RightSized Event reads), else the request's
deviceClassName, selectors and capacity; `original_size` reads both back.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from driver.sizing.history import HOUR_S
from driver.sizing.offers import Offers
from driver.sizing.recommend import PIN_ANNOTATION, Policy, Recommendation, in_cooldown
from driver.sizing.request import SHARE_KINDS, mib, request_size, resize_ops, whole
from driver.sizing.sizes import GpuModel, Size, capacity_key, gpu_model, memory_limit_mib, mib_text

RIGHTSIZE = PIN_ANNOTATION  # the namespace's label and the claim's annotation: "initial" or "off"
INITIAL = "initial"
OFF = "off"
ORIGINAL_ANNOTATION = "gpu.fgpu.dev/rightsize-original"  # {request: what it asked, module docstring}
ORIGINAL_FIELDS = ("deviceClassName", "selectors", "capacity")  # of a request that changed kind or partition
# Kueue's deviceClassMappings (docs/kueue.md): the quota resource a request of each kind counts against.
QUOTA_GPUS = "gpu.fgpu.dev/gpus"
QUOTA_MIG_SLICES = "gpu.fgpu.dev/mig-slices"
SHARE_QUOTA = "gpu.fgpu.dev/share-memory"
# What a move may drop from a request's selectors: its product (the new selector pins it again) and
# the sizes it asks (a MIG profile, memory, compute: what sizing replaces). Anything else (a
# capability, a driver version, a topology) a move would lose, so it is not made.
SIZING_FIELDS = frozenset({"attributes.productName", "attributes.profile", "capacity.memory", "capacity.compute"})
# device.attributes["domain"].name / device.capacity["domain"].name / device.<field>
_DEVICE_REFERENCE = re.compile(r'device\.(attributes|capacity)(?:\["[^"]*"\]\.(\w+)|\.(\w+))?|device\.(\w+)')

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
    """One request of the claim, sized."""

    name: str
    before: Size  # as the claim asked (the class defaults filled in)
    after: Size
    original: JsonObject  # its entry in ORIGINAL_ANNOTATION
    ops: tuple[JsonObject, ...]
    recommendation: Recommendation


@dataclass(frozen=True)
class ClaimSizing:
    sized: tuple[RequestSizing, ...]
    skipped: tuple[str, ...]  # per request not sized, why (for the log)

    def patch(self, claim: JsonObject) -> list[JsonObject]:
        """The JSON patch (RFC 6902) sizing the requests and setting the annotation with the
        original requests; no `test` operation, whose failure would refuse the claim."""
        if not self.sized:
            return []
        ops = [op for s in self.sized for op in s.ops]
        original = json.dumps({s.name: s.original for s in self.sized}, sort_keys=True, separators=(",", ":"))
        if (claim.get("metadata") or {}).get("annotations"):
            ops.append(
                {"op": "add", "path": "/metadata/annotations/" + _pointer(ORIGINAL_ANNOTATION), "value": original}
            )
        else:
            ops.append({"op": "add", "path": "/metadata/annotations", "value": {ORIGINAL_ANNOTATION: original}})
        return ops

    def warnings(self) -> list[str]:
        """What the user sees at create (admission warnings): each change, and its Kueue quota."""
        out = []
        for s in self.sized:
            rec, observed = s.recommendation, s.recommendation.observed
            out.append(
                f"gpu.fgpu.dev rightsize: request {s.name} sized {s.before.describe()} -> {s.after.describe()} "
                f"({rec.reason}: peak {observed.memory_peak_mib}Mi over {observed.span_s / HOUR_S:.0f} h); "
                f"the original is in annotation {ORIGINAL_ANNOTATION}"
            )
            gpu = gpu_model(rec.gpu)
            (was, charged), (now, charge) = quota(s.before, gpu), quota(s.after, gpu)
            if was != now:
                out.append(
                    f"gpu.fgpu.dev rightsize: request {s.name} moves to Kueue quota {now} ({charge}) "
                    f"from {was} ({charged}): its ClusterQueue needs quota of {now}"
                )
            elif charged != charge:
                out.append(
                    f"gpu.fgpu.dev rightsize: request {s.name} now counts {charge} of Kueue quota {now}, not {charged}"
                )
        return out


def quota(size: Size, gpu: GpuModel) -> tuple[str, str]:
    """The Kueue quota resource a one-device request of this size counts against, and how much."""
    if size.kind == "whole":
        return QUOTA_GPUS, "1"
    if size.kind == "mig" and size.profile is not None:
        return QUOTA_MIG_SLICES, str(gpu.mig(size.profile).memory_slices)
    return SHARE_QUOTA, mib_text(size.memory_mib or 0)


def size_claim(
    claim: JsonObject,
    recommendations: Mapping[str, Recommendation],
    now: float,
    policy: Policy = Policy(),
    offers: Offers = Offers(),
) -> ClaimSizing:
    """The claim's requests sized to their workload's recommendations (by request name), by the
    module's rules."""
    sized: list[RequestSizing] = []
    skipped: list[str] = []
    devices = (claim.get("spec") or {}).get("devices") or {}
    for index, request in enumerate(devices.get("requests") or ()):
        name = str(request.get("name", ""))
        rec = recommendations.get(name)
        if rec is None:
            skipped.append(f"request {name}: no usage history")
            continue
        result = _size_request(index, request, devices, rec, now, policy, offers)
        if isinstance(result, str):
            skipped.append(f"request {name}: {result}")
        else:
            sized.append(result)
    return ClaimSizing(tuple(sized), tuple(skipped))


def _size_request(
    index: int, request: JsonObject, devices: JsonObject, rec: Recommendation, now: float, policy: Policy,
    offers: Offers,
) -> RequestSizing | str:  # fmt: skip
    """The request sized, or why not."""
    exactly = request.get("exactly")
    if not isinstance(exactly, dict):
        return "not an `exactly` request (firstAvailable is not sized)"
    if not rec.decided:
        return rec.reason
    gpu = gpu_model(rec.gpu)
    try:
        asked = request_size(exactly, gpu)
    except ValueError as err:  # QuantityError too
        return f"not understood: {err}"
    target = rec.recommended
    peak = rec.observed.memory_peak_mib
    if ((target.memory_mib or 0) if target.kind in SHARE_KINDS else memory_limit_mib(target, gpu)) < peak:
        return f"recommended {target.describe()} is below the observed peak {peak}Mi"
    moves = (target.kind, target.profile) != (asked.kind, asked.profile)
    why_not = _why_not_move(request, devices, target, rec.gpu, offers) if moves else None
    if why_not:
        return f"recommended {target.describe()}, not made: {why_not}"
    if in_cooldown(rec.observed, now, policy):  # after an out-of-memory: raised, never shrunk
        target = _not_below(asked, target, gpu)
    if target == asked:
        return f"kept at {asked.describe()} ({rec.reason})"
    capacity = {str(k): str(v) for k, v in ((exactly.get("capacity") or {}).get("requests") or {}).items()}
    base = f"/spec/devices/requests/{index}/exactly"
    ops = resize_ops(base, asked, target, rec.gpu, capacity)
    kind_kept = (target.kind, target.profile) == (asked.kind, asked.profile)
    original = capacity if kind_kept else {key: exactly[key] for key in ORIGINAL_FIELDS if key in exactly}
    return RequestSizing(str(request.get("name", "")), asked, target, original, tuple(ops), rec)


def _why_not_move(request: JsonObject, devices: JsonObject, target: Size, product: str, offers: Offers) -> str | None:
    """Why a change of kind or partition is not plainly safe for this request (module docstring)."""
    exactly, name = request["exactly"], request.get("name")
    if exactly.get("allocationMode", "ExactCount") != "ExactCount" or int(exactly.get("count", 1)) != 1:
        return "it asks for more than one device"
    if exactly.get("adminAccess"):
        return "it asks for admin access"
    for field in ("constraints", "config"):
        if any(not item.get("requests") or name in item["requests"] for item in devices.get(field) or ()):
            return f"a {field[:-1] if field == 'constraints' else field} of the claim applies to it"
    kept_out = sorted(_selected_fields(exactly) - SIZING_FIELDS)
    if kept_out:
        return f"its selectors ask for {', '.join(kept_out)}, which the new size's selector would drop"
    return offers.why_not(product, target)


def _selected_fields(exactly: JsonObject) -> set[str]:
    """What the request's CEL selectors read of a device: `attributes.<name>`, `capacity.<name>`,
    or the bare `device.<field>` (driver, allowMultipleAllocations, ...)."""
    fields: set[str] = set()
    for item in exactly.get("selectors") or ():
        expression = str(((item or {}).get("cel") or {}).get("expression", ""))
        for reference in _DEVICE_REFERENCE.finditer(expression):
            table, name, bare = reference.group(1), reference.group(2) or reference.group(3), reference.group(4)
            fields.add(bare or (f"{table}.{name}" if name else table))  # a table read whole: not known, kept
    return fields


def _not_below(asked: Size, target: Size, gpu: GpuModel) -> Size:
    """The target, never below what the claim asks: a share's memory and compute each, another
    kind or partition as a whole (the larger of the two)."""
    if (target.kind, target.profile) == (asked.kind, asked.profile):
        return replace(
            target,
            memory_mib=_larger(target.memory_mib, asked.memory_mib),
            compute_percent=_larger(target.compute_percent, asked.compute_percent),
        )
    return max(asked, target, key=lambda size: capacity_key(size, gpu))


def _larger(a: int | None, b: int | None) -> int | None:
    return a if b is None else b if a is None else max(a, b)


def original_size(annotations: Mapping[str, str], request: str, size: Size, product: str) -> Size | None:
    """The request's size before automatic sizing (the ORIGINAL_ANNOTATION the webhook wrote): its
    kind and partition where they changed, else the sized claim's; None where it was not sized or
    the annotation cannot be read (it is the user's to edit)."""
    try:
        before = json.loads(annotations.get(ORIGINAL_ANNOTATION) or "{}").get(request)
        if not isinstance(before, dict):
            return None
        if "deviceClassName" in before:
            return request_size(before, gpu_model(product))
        memory, compute = mib(before.get("memory")), whole(before.get("compute"))
    except (ValueError, AttributeError):  # QuantityError, JSONDecodeError, UnknownGpuError are ValueErrors
        return None
    return Size(size.kind, memory if memory is not None else size.memory_mib, compute, size.profile)


def _pointer(key: str) -> str:
    """A map key as a JSON Pointer token (RFC 6901)."""
    return key.replace("~", "~0").replace("/", "~1")
