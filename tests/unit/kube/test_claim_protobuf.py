"""status.devices edited in a claim's protobuf encoding: our entries replaced, every other byte
kept (the allocation's opaque configs and other drivers' data are compared byte for byte by
kube-apiserver). The bytes here are built field by field as Kubernetes' generated code lays them
out, with fields the plugin's subset of the messages does not know (and some no API server has
yet); tests/integration/test_claim_status.py runs the same code against the real kube-apiserver."""

from __future__ import annotations

import json

import pytest
from google.protobuf.message import Message
from google.protobuf.unknown_fields import UnknownFieldSet
from hypothesis import given
from hypothesis import strategies as st

from driver.kube import claim_protobuf as pb
from driver.kube import resourceclaim_status_pb2 as messages

DRIVER = "gpu.fgpu.dev"
# An opaque config as a Python client sends it (spaces, keys unsorted): what must survive verbatim.
CONFIG = b'{"kind": "ShareConfig", "apiVersion": "gpu.fgpu.dev/v1alpha1", "sharing": {"strategy": "TimeSlicing"}}'
NIC_DATA = b'{"mac":"02:00:00:00:00:01", "b":1}'


# --- the wire format, for building claims with fields the plugin does not declare -------------------


def varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    return bytes([*out, value])


def field(number: int, payload: bytes) -> bytes:
    return varint(number << 3 | 2) + varint(len(payload)) + payload


def text(number: int, value: str) -> bytes:
    return field(number, value.encode())


def number(field_number: int, value: int) -> bytes:
    return varint(field_number << 3) + varint(value)


TYPE_META = field(1, text(1, "resource.k8s.io/v1") + text(2, "ResourceClaim"))
NEWER = number(99, 7) + field(98, b"from a newer API server")  # fields no API server has yet


def entry_bytes(driver: str, pool: str, device: str, data: bytes = b"{}", share: str = "") -> bytes:
    fields = text(1, driver) + text(2, pool) + text(3, device)
    fields += field(5, field(1, data))
    if share:
        fields += text(7, share)
    return field(4, fields)


def nic_entry() -> bytes:
    """Another driver's AllocatedDeviceStatus, with a condition and fields unknown to us at each level."""
    time = number(1, 1767225600) + number(2, 5) + NEWER
    condition = text(1, "Ready") + text(2, "True") + number(3, 0) + field(4, time) + text(5, "Up") + text(6, "")
    network = text(1, "eth1") + text(2, "10.0.0.1") + text(2, "fd00::1") + text(3, "02:00:00:00:00:01")
    fields = text(1, "net.example.com") + text(2, "node-a") + text(3, "eth1") + field(4, condition + NEWER)
    return fields + field(5, field(1, NIC_DATA) + NEWER) + field(6, network + NEWER) + NEWER


def allocation() -> bytes:
    opaque = field(1, text(1, DRIVER) + field(2, field(1, CONFIG)))
    config = field(2, text(1, "FromClaim") + text(2, "gpu") + field(3, opaque))
    result = field(1, text(1, "gpu") + text(2, DRIVER) + text(3, "node-a"))
    return field(1, field(1, result + config))


def claim(devices: list[bytes]) -> bytes:
    meta = text(1, "c") + text(3, "default") + text(5, "uid-1") + text(6, "42") + number(7, 3) + NEWER
    spec = field(2, b"\x0a\x03abc")
    reserved = field(2, text(3, "pods"))
    status = allocation() + reserved + b"".join(devices) + NEWER
    return field(1, meta) + spec + field(3, status) + NEWER


def envelope(obj: bytes) -> bytes:
    return pb.MAGIC + TYPE_META + field(2, obj) + text(3, "") + text(4, "")


def ours(key: pb.DeviceKey) -> bool:
    return key[:2] == (DRIVER, "node-a")


def our_entry(device: str, share: str = "") -> dict:
    condition = {"type": "Ready", "status": "True", "reason": "Prepared", "message": "m"}
    condition |= {"lastTransitionTime": "2026-05-04T03:02:01Z", "observedGeneration": 2}
    entry = {"driver": DRIVER, "pool": "node-a", "device": device, "conditions": [condition]}
    entry["data"] = {"kind": "timeslice", "timeSlice": {"interval": "Long"}}
    return {**entry, "shareID": share} if share else entry


def unknown(message: Message) -> list[tuple[int, int, bytes]]:
    """The fields of `message` that the plugin's messages do not declare, as they were encoded."""
    return [(f.field_number, f.wire_type, f.data) for f in UnknownFieldSet(message)]


# --- tests ---------------------------------------------------------------------------------------


def test_the_messages_have_the_apis_field_numbers():
    """Those of k8s.io/api v0.37.2 resource/v1 and k8s.io/apimachinery v0.37.2 generated.proto."""
    upstream = {
        "Unknown": {"raw": 2},
        "ResourceClaim": {"metadata": 1, "status": 3},
        "ObjectMeta": {"uid": 5, "resourceVersion": 6},
        "ResourceClaimStatus": {"devices": 4},
        "AllocatedDeviceStatus": {
            "driver": 1,
            "pool": 2,
            "device": 3,
            "conditions": 4,
            "data": 5,
            "networkData": 6,
            "shareID": 7,
        },
        "Condition": {
            "type": 1,
            "status": 2,
            "observedGeneration": 3,
            "lastTransitionTime": 4,
            "reason": 5,
            "message": 6,
        },
        "Time": {"seconds": 1, "nanos": 2},
        "RawExtension": {"raw": 1},
        "NetworkDeviceData": {"interfaceName": 1, "ips": 2, "hardwareAddress": 3},
    }
    declared = {
        name: {f.name: f.number for f in message.fields}
        for name, message in messages.DESCRIPTOR.message_types_by_name.items()
    }
    assert declared == upstream
    assert messages.DESCRIPTOR.package == "fgpu.resourceclaimstatus"  # never clashes with upstream's


def test_our_entries_are_replaced_and_every_other_byte_is_kept():
    nic = nic_entry()
    old = claim([entry_bytes(DRIVER, "node-a", "gpu-0"), field(4, nic), entry_bytes(DRIVER, "node-a", "gpu-1")])
    body = envelope(old)
    edited = pb.rewrap(body, pb.with_devices(pb.unwrap(body), ours, [our_entry("gpu-3-ts", "s-1")]))

    new = pb.unwrap(edited)
    assert edited.startswith(pb.MAGIC) and pb.unwrap(body) == old
    assert unknown(messages.Unknown.FromString(edited[4:])) == unknown(messages.Unknown.FromString(body[4:]))
    assert pb.identity(new) == pb.ClaimIdentity("uid-1", "42")
    assert pb.status_device_keys(new) == [
        (DRIVER, "node-a", "gpu-3-ts", "s-1"),
        ("net.example.com", "node-a", "eth1", ""),
    ]
    before, after = messages.ResourceClaim.FromString(old), messages.ResourceClaim.FromString(new)
    # spec, the allocation (its config bytes), reservedFor, the metadata we do not read, new fields:
    for part in (lambda c: c, lambda c: c.metadata, lambda c: c.status):
        assert unknown(part(after)) == unknown(part(before)) != []
    assert after.metadata == before.metadata
    assert after.status.devices[1].SerializeToString() == nic  # the NIC's entry, to the last byte
    assert CONFIG in new and NIC_DATA in new and new.count(NEWER) == old.count(NEWER) == 8

    cleared = pb.with_devices(new, ours, [])
    assert pb.status_device_keys(cleared) == [("net.example.com", "node-a", "eth1", "")]
    assert pb.with_devices(pb.with_devices(cleared, ours, []), ours, []) == cleared


def test_an_entry_is_encoded_as_the_apis_generated_code_reads_it():
    entry = pb.encode_device_status(our_entry("gpu-0"))
    assert not entry.HasField("shareID")  # a nil pointer in Go, not an empty share ID
    assert not entry.HasField("networkData")
    assert entry.device == "gpu-0"
    assert json.loads(entry.data.raw) == {"kind": "timeslice", "timeSlice": {"interval": "Long"}}
    assert b" " not in entry.data.raw
    (condition,) = entry.conditions
    assert condition.observedGeneration == 2 and condition.reason == "Prepared"
    assert condition.lastTransitionTime.seconds == 1777863721  # 2026-05-04T03:02:01Z
    assert pb.encode_device_status(our_entry("gpu-0", "s-1")).shareID == "s-1"
    network = {"interfaceName": "eth0", "ips": ["10.0.0.2/24"]}
    assert pb.encode_device_status({**our_entry("nic"), "networkData": network}).networkData.ips == ["10.0.0.2/24"]


def test_a_claim_without_status_gets_one_and_foreign_bytes_are_refused():
    bare = field(1, text(5, "u"))
    assert pb.status_device_keys(pb.with_devices(bare, ours, [our_entry("gpu-0")])) == [(DRIVER, "node-a", "gpu-0", "")]
    with pytest.raises(pb.ProtobufError):
        pb.unwrap(b'{"kind": "ResourceClaim"}')
    with pytest.raises(pb.ProtobufError):
        pb.identity(field(1, b"abc")[:-1])  # truncated
    with pytest.raises(pb.ProtobufError):
        pb.unwrap(pb.MAGIC + field(2, b"abc")[:-1])


@given(
    st.lists(
        st.tuples(st.sampled_from([DRIVER, "net.example.com"]), st.sampled_from(["node-a", "node-b"]), st.text()),
        max_size=6,
    ),
    st.lists(st.text(min_size=1), max_size=3),
)
def test_only_our_nodes_entries_change(existing: list[tuple[str, str, str]], devices: list[str]):
    old = claim([entry_bytes(d, p, name) for d, p, name in existing])
    new = pb.with_devices(old, ours, [our_entry(name) for name in devices])
    others = [(d, p, name, "") for d, p, name in existing if not ours((d, p, name, ""))]
    assert sorted(pb.status_device_keys(new)) == sorted(others + [(DRIVER, "node-a", name, "") for name in devices])
    assert [k for k in pb.status_device_keys(new) if not ours(k)] == others  # their order kept
    if devices and len(others) < len(existing):  # ours take the place of the first one replaced
        first = next(i for i, (d, p, name) in enumerate(existing) if ours((d, p, name, "")))
        assert pb.status_device_keys(new)[first][:2] == (DRIVER, "node-a")
