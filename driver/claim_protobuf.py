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

Only the wire format is read here (no generated classes): the envelope (runtime.Unknown after the
`k8s\\0` magic), ResourceClaim.metadata (uid, resourceVersion), ResourceClaim.status.devices, and
the keys of each AllocatedDeviceStatus. Field numbers are those of k8s.io/api/resource/v1 and
k8s.io/apimachinery's generated.proto.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any

MAGIC = b"k8s\x00"
CONTENT_TYPE = "application/vnd.kubernetes.protobuf"
VARINT, FIXED64, LENGTH, FIXED32 = 0, 1, 2, 5
DeviceKey = tuple[str, str, str, str]  # driver, pool, device, shareID ("" for none): the list's map key
JsonObject = dict[str, Any]

# Field numbers (generated.proto)
UNKNOWN_RAW = 2  # runtime.Unknown.raw: the object
CLAIM_METADATA, CLAIM_STATUS = 1, 3  # ResourceClaim
META_UID, META_RESOURCE_VERSION = 5, 6  # ObjectMeta
STATUS_DEVICES = 4  # ResourceClaimStatus (1 allocation and 2 reservedFor are kept as they are)
DEV_DRIVER, DEV_POOL, DEV_DEVICE, DEV_CONDITIONS, DEV_DATA, DEV_NETWORK, DEV_SHARE_ID = 1, 2, 3, 4, 5, 6, 7
COND_TYPE, COND_STATUS, COND_GENERATION, COND_TIME, COND_REASON, COND_MESSAGE = 1, 2, 3, 4, 5, 6
TIME_SECONDS = 1
RAW_BYTES = 1  # runtime.RawExtension.raw
NET_INTERFACE, NET_IPS, NET_HARDWARE_ADDRESS = 1, 2, 3


class ProtobufError(ValueError):
    """The bytes are not the protobuf encoding this module expects."""


@dataclass(frozen=True)
class Field:
    number: int
    value: int | bytes  # a varint's value, or a length-delimited field's payload
    span: bytes  # the field as encoded (tag and value), kept verbatim when not edited


# --- wire format ---------------------------------------------------------------------------------


def _read_varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(data):
            raise ProtobufError("truncated varint")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise ProtobufError("varint too long")


def varint(value: int) -> bytes:
    value &= (1 << 64) - 1  # negative int64s as protobuf writes them: two's complement, 10 bytes
    out = bytearray()
    while True:
        low = value & 0x7F
        value >>= 7
        if value:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def fields(data: bytes) -> Iterator[Field]:
    """The message's fields in order; groups (unused by Kubernetes) are refused."""
    pos = 0
    while pos < len(data):
        start = pos
        tag, pos = _read_varint(data, pos)
        number, wire = tag >> 3, tag & 7
        value: int | bytes
        if wire == VARINT:
            value, pos = _read_varint(data, pos)
        elif wire == LENGTH:
            size, pos = _read_varint(data, pos)
            if pos + size > len(data):
                raise ProtobufError(f"field {number} runs past the message")
            value, pos = data[pos : pos + size], pos + size
        elif wire in (FIXED64, FIXED32):
            width = 8 if wire == FIXED64 else 4
            value, pos = int.from_bytes(data[pos : pos + width], "little"), pos + width
        else:
            raise ProtobufError(f"field {number}: unsupported wire type {wire}")
        yield Field(number, value, data[start:pos])


def length_field(number: int, payload: bytes) -> bytes:
    return varint(number << 3 | LENGTH) + varint(len(payload)) + payload


def varint_field(number: int, value: int) -> bytes:
    return varint(number << 3 | VARINT) + varint(value)


def string_field(number: int, text: str) -> bytes:
    return length_field(number, text.encode())


def _payload(message: bytes, number: int) -> bytes:
    """The last occurrence of a length-delimited field (protobuf's rule for singular fields)."""
    found = b""
    for field in fields(message):
        if field.number == number and isinstance(field.value, bytes):
            found = field.value
    return found


def _text(message: bytes, number: int) -> str:
    return _payload(message, number).decode()


# --- the claim -----------------------------------------------------------------------------------


def unwrap(body: bytes) -> bytes:
    """The object inside the API server's protobuf envelope."""
    if not body.startswith(MAGIC):
        raise ProtobufError("not a Kubernetes protobuf object (no k8s magic)")
    return _payload(body[len(MAGIC) :], UNKNOWN_RAW)


def rewrap(body: bytes, claim: bytes) -> bytes:
    """The envelope of `body` (its apiVersion and kind) around another encoding of the object."""
    envelope = b"".join(
        length_field(UNKNOWN_RAW, claim) if field.number == UNKNOWN_RAW else field.span
        for field in fields(body[len(MAGIC) :])
    )
    return MAGIC + envelope


@dataclass(frozen=True)
class ClaimIdentity:
    uid: str
    resource_version: str


def identity(claim: bytes) -> ClaimIdentity:
    meta = _payload(claim, CLAIM_METADATA)
    return ClaimIdentity(_text(meta, META_UID), _text(meta, META_RESOURCE_VERSION))


def device_key(entry: bytes) -> DeviceKey:
    """The map key of an encoded AllocatedDeviceStatus."""
    return (
        _text(entry, DEV_DRIVER),
        _text(entry, DEV_POOL),
        _text(entry, DEV_DEVICE),
        _text(entry, DEV_SHARE_ID),
    )


def status_device_keys(claim: bytes) -> list[DeviceKey]:
    status = _payload(claim, CLAIM_STATUS)
    return [device_key(f.value) for f in fields(status) if f.number == STATUS_DEVICES and isinstance(f.value, bytes)]


def with_devices(claim: bytes, replaced: Callable[[DeviceKey], bool], entries: list[JsonObject]) -> bytes:
    """The claim with the status.devices entries for which `replaced` holds swapped for `entries`
    (in the place of the first one replaced, else after the others); every other field, other
    entries included, byte for byte as it was."""
    status = _swap_entries(_payload(claim, CLAIM_STATUS), replaced, b"".join(map(encode_device_status, entries)))
    out, placed = [], False
    for field in fields(claim):
        if field.number == CLAIM_STATUS:
            if not placed:
                out.append(length_field(CLAIM_STATUS, status))
                placed = True
            continue
        out.append(field.span)
    if not placed:
        out.append(length_field(CLAIM_STATUS, status))
    return b"".join(out)


def _swap_entries(status: bytes, replaced: Callable[[DeviceKey], bool], encoded: bytes) -> bytes:
    out, placed = [], False
    for field in fields(status):
        if field.number == STATUS_DEVICES and isinstance(field.value, bytes) and replaced(device_key(field.value)):
            if not placed:
                out.append(encoded)
                placed = True
            continue
        out.append(field.span)
    if not placed:
        out.append(encoded)
    return b"".join(out)


# --- our entries ---------------------------------------------------------------------------------


def encode_device_status(entry: JsonObject) -> bytes:
    """An AllocatedDeviceStatus from its JSON form (the API's field names); `data` becomes compact
    JSON, as the API server would store it from any client."""
    parts = [
        string_field(DEV_DRIVER, entry["driver"]),
        string_field(DEV_POOL, entry["pool"]),
        string_field(DEV_DEVICE, entry["device"]),
    ]
    parts += [length_field(DEV_CONDITIONS, encode_condition(c)) for c in entry.get("conditions") or []]
    if entry.get("data") is not None:
        data = json.dumps(entry["data"], separators=(",", ":"), ensure_ascii=False).encode()
        parts.append(length_field(DEV_DATA, length_field(RAW_BYTES, data)))
    if entry.get("networkData") is not None:
        parts.append(length_field(DEV_NETWORK, encode_network_data(entry["networkData"])))
    if entry.get("shareID"):  # a pointer in Go: absent, not empty, for a device without shares
        parts.append(string_field(DEV_SHARE_ID, entry["shareID"]))
    return length_field(STATUS_DEVICES, b"".join(parts))


def encode_condition(condition: JsonObject) -> bytes:
    """metav1.Condition; its time in whole seconds (RFC 3339 as the JSON form writes it)."""
    when = datetime.fromisoformat(condition["lastTransitionTime"].replace("Z", "+00:00"))
    return b"".join(
        [
            string_field(COND_TYPE, condition["type"]),
            string_field(COND_STATUS, condition["status"]),
            varint_field(COND_GENERATION, int(condition.get("observedGeneration") or 0)),
            length_field(COND_TIME, varint_field(TIME_SECONDS, int(when.timestamp()))),
            string_field(COND_REASON, condition["reason"]),
            string_field(COND_MESSAGE, condition.get("message") or ""),
        ]
    )


def encode_network_data(network: JsonObject) -> bytes:
    parts = [string_field(NET_INTERFACE, network.get("interfaceName") or "")]
    parts += [string_field(NET_IPS, ip) for ip in network.get("ips") or []]
    parts.append(string_field(NET_HARDWARE_ADDRESS, network.get("hardwareAddress") or ""))
    return b"".join(parts)
