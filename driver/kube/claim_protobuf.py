"""A ResourceClaim's `status.devices` edited in the API server's protobuf encoding, every other
byte of the claim kept as the server sent it.

Why protobuf: kube-apiserver compares a claim's `status.allocation` before and after a status
write with `equality.Semantic.DeepEqual` and refuses any difference (k8s.io/kubernetes v1.37.2,
pkg/registry/resource/resourceclaim/strategy.go `resourceclaimStatusStrategy.ValidateUpdate` ->
pkg/apis/resource/v1/zz_generated.validations.go `Validate_ResourceClaimStatus`, NoModify: 422
"status.allocation: Invalid value: null: field cannot be modified once set"; the handwritten
`ValidateResourceClaimStatusUpdate` in pkg/apis/resource/validation does the same). An opaque
config's `parameters` is a `runtime.RawExtension`, compared as raw bytes, and stored as its author
sent it (apimachinery pkg/runtime/extension.go `UnmarshalJSON` keeps the bytes: key order,
spaces); kube-scheduler copies those bytes into the allocation (protobuf). Every JSON route
re-encodes them:
- server-side apply and merge patches turn the live object into a map and back
  (apimachinery pkg/runtime/converter.go `ToUnstructured`/`FromUnstructured`: json.Marshal, sorted
  keys, no spaces), so bytes not in that form (a Python client's spaces, a Go struct's key order)
  read as a modified allocation;
- a JSON read compacts them and a PUT carries what the client serialises (the Python client:
  spaces), so a PUT from Python fails on bytes in any other form (kubectl's, helm's).
Measured against kube-apiserver 1.37.2 both ways. Only protobuf carries the bytes verbatim in and
out. The same holds for other drivers' `status.devices[].data`, compared per driver before
authorizing the write (pkg/registry/resource/utils.go `AuthorizedForDeviceStatus`): re-encoded,
they would read as our changing another driver's entries.

The messages are a subset of the API's (proto/resourceclaim_status.proto: the envelope, the
claim's uid and resourceVersion, status.devices). Every other field (spec, status.allocation,
reservedFor, a newer server's fields) is an unknown field to protobuf, written back byte for byte;
protobuf writes the known fields first, in field-number order, which is no change to the object
(the API server decodes before it compares).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TypeVar

from google.protobuf.message import DecodeError, Message

from driver.kube.resourceclaim_status_pb2 import (
    AllocatedDeviceStatus,
    Condition,
    NetworkDeviceData,
    RawExtension,
    ResourceClaim,
    Time,
    Unknown,
)

MAGIC = b"k8s\x00"
CONTENT_TYPE = "application/vnd.kubernetes.protobuf"
DeviceKey = tuple[str, str, str, str]  # driver, pool, device, shareID ("" for none): the list's map key
JsonObject = dict[str, Any]
M = TypeVar("M", bound=Message)


class ProtobufError(ValueError):
    """The bytes are not the protobuf encoding this module expects."""


def _parse(message_type: type[M], data: bytes) -> M:
    try:
        return message_type.FromString(data)
    except DecodeError as err:
        raise ProtobufError(f"not a {message_type.__name__}: {err}") from err


def _envelope(body: bytes) -> Unknown:
    if not body.startswith(MAGIC):
        raise ProtobufError("not a Kubernetes protobuf object (no k8s magic)")
    return _parse(Unknown, body[len(MAGIC) :])


def unwrap(body: bytes) -> bytes:
    """The object inside the API server's protobuf envelope."""
    return _envelope(body).raw


def rewrap(body: bytes, claim: bytes) -> bytes:
    """The envelope of `body` (its apiVersion and kind) around another encoding of the object."""
    envelope = _envelope(body)
    envelope.raw = claim
    return MAGIC + envelope.SerializeToString()


@dataclass(frozen=True)
class ClaimIdentity:
    uid: str
    resource_version: str


def identity(claim: bytes) -> ClaimIdentity:
    meta = _parse(ResourceClaim, claim).metadata
    return ClaimIdentity(meta.uid, meta.resourceVersion)


def device_key(entry: AllocatedDeviceStatus) -> DeviceKey:
    return entry.driver, entry.pool, entry.device, entry.shareID


def status_device_keys(claim: bytes) -> list[DeviceKey]:
    return [device_key(entry) for entry in _parse(ResourceClaim, claim).status.devices]


def with_devices(claim: bytes, replaced: Callable[[DeviceKey], bool], entries: list[JsonObject]) -> bytes:
    """The claim with the status.devices entries for which `replaced` holds swapped for `entries`
    (in the place of the first one replaced, else after the others); every other field, other
    entries included, as it was."""
    message = _parse(ResourceClaim, claim)
    devices = message.status.devices
    old = [(entry, replaced(device_key(entry))) for entry in devices]
    at = next((i for i, (_, mine) in enumerate(old) if mine), len(old))
    kept = [entry for entry, mine in old if not mine]
    new = [*kept[:at], *map(encode_device_status, entries), *kept[at:]]
    del devices[:]
    devices.extend(new)
    return message.SerializeToString()


def encode_device_status(entry: JsonObject) -> AllocatedDeviceStatus:
    """An AllocatedDeviceStatus from its JSON form (the API's field names); `data` becomes compact
    JSON, as the API server would store it from any client."""
    data, network = entry.get("data"), entry.get("networkData")
    return AllocatedDeviceStatus(
        driver=entry["driver"],
        pool=entry["pool"],
        device=entry["device"],
        shareID=entry.get("shareID") or None,  # a pointer in Go: absent, not empty, for a device without shares
        conditions=[_condition(c) for c in entry.get("conditions") or []],
        data=None if data is None else RawExtension(raw=_compact_json(data)),
        networkData=None if network is None else _network_data(network),
    )


def _compact_json(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()


def _condition(condition: JsonObject) -> Condition:
    """metav1.Condition; its time in whole seconds (RFC 3339 as the JSON form writes it)."""
    when = datetime.fromisoformat(condition["lastTransitionTime"])
    return Condition(
        type=condition["type"],
        status=condition["status"],
        observedGeneration=int(condition.get("observedGeneration") or 0),
        lastTransitionTime=Time(seconds=int(when.timestamp())),
        reason=condition["reason"],
        message=condition.get("message") or "",
    )


def _network_data(network: JsonObject) -> NetworkDeviceData:
    return NetworkDeviceData(
        interfaceName=network.get("interfaceName") or "",
        ips=network.get("ips") or [],
        hardwareAddress=network.get("hardwareAddress") or "",
    )
