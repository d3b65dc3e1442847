"""status.devices edited in a claim's protobuf encoding: our entries replaced, every other byte
kept (the allocation's opaque configs and other drivers' data are compared byte for byte by
kube-apiserver). The bytes here are built field by field as Kubernetes' generated code lays them
out; tests/integration/test_claim_status.py runs the same code against the real kube-apiserver."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from driver import claim_protobuf as pb
from driver.claim_protobuf import length_field, string_field

DRIVER = "gpu.fgpu.dev"
# An opaque config as a Python client sends it (spaces, keys unsorted): what must survive verbatim.
CONFIG = b'{"kind": "ShareConfig", "apiVersion": "gpu.fgpu.dev/v1alpha1", "sharing": {"strategy": "TimeSlicing"}}'
NIC_DATA = b'{"mac":"02:00:00:00:00:01", "b":1}'
TYPE_META = length_field(1, string_field(1, "resource.k8s.io/v1") + string_field(2, "ResourceClaim"))


def entry_bytes(driver: str, pool: str, device: str, data: bytes = b"{}", share: str = "") -> bytes:
    fields = string_field(1, driver) + string_field(2, pool) + string_field(3, device)
    fields += length_field(5, length_field(1, data))
    if share:
        fields += string_field(7, share)
    return length_field(pb.STATUS_DEVICES, fields)


def allocation() -> bytes:
    opaque = length_field(1, string_field(1, DRIVER) + length_field(2, length_field(1, CONFIG)))
    config = length_field(2, string_field(1, "FromClaim") + string_field(2, "gpu") + length_field(3, opaque))
    result = length_field(1, string_field(1, "gpu") + string_field(2, DRIVER) + string_field(3, "node-a"))
    return length_field(1, length_field(1, result + config))


def claim(devices: list[bytes]) -> bytes:
    meta = string_field(1, "c") + string_field(3, "default") + string_field(5, "uid-1") + string_field(6, "42")
    spec = length_field(2, b"\x0a\x03abc")
    reserved = length_field(2, string_field(3, "pods"))
    status = allocation() + reserved + b"".join(devices)
    return length_field(1, meta) + spec + length_field(3, status)


def envelope(obj: bytes) -> bytes:
    return pb.MAGIC + TYPE_META + length_field(2, obj) + string_field(3, "") + string_field(4, "")


def ours(key: pb.DeviceKey) -> bool:
    return key[:2] == (DRIVER, "node-a")


def status_fields(obj: bytes) -> list[pb.Field]:
    return list(pb.fields(next(f.value for f in pb.fields(obj) if f.number == pb.CLAIM_STATUS)))


def our_entry(device: str, share: str = "") -> dict:
    condition = {"type": "Ready", "status": "True", "reason": "Prepared", "message": "m"}
    condition |= {"lastTransitionTime": "2026-05-04T03:02:01Z", "observedGeneration": 2}
    entry = {"driver": DRIVER, "pool": "node-a", "device": device, "conditions": [condition]}
    entry["data"] = {"kind": "timeslice", "timeSlice": {"interval": "Long"}}
    return {**entry, "shareID": share} if share else entry


def test_our_entries_are_replaced_and_every_other_byte_is_kept():
    nic = entry_bytes("net.example.com", "node-a", "eth1", NIC_DATA)
    old = claim([entry_bytes(DRIVER, "node-a", "gpu-0"), nic, entry_bytes(DRIVER, "node-a", "gpu-1")])
    body = envelope(old)
    edited = pb.rewrap(body, pb.with_devices(pb.unwrap(body), ours, [our_entry("gpu-3-ts", "s-1")]))

    assert edited.startswith(pb.MAGIC + TYPE_META)
    new = pb.unwrap(edited)
    assert pb.identity(new) == pb.ClaimIdentity("uid-1", "42")
    assert pb.status_device_keys(new) == [
        (DRIVER, "node-a", "gpu-3-ts", "s-1"),
        ("net.example.com", "node-a", "eth1", ""),
    ]
    before, after = status_fields(old), status_fields(new)
    kept = [f.span for f in before if f.number != pb.STATUS_DEVICES] + [nic]
    assert [f.span for f in after if f.span in kept] == kept  # allocation (its config bytes), reservedFor, the NIC
    assert CONFIG in new and NIC_DATA in new
    assert [f.span for f in pb.fields(new) if f.number != pb.CLAIM_STATUS] == [
        f.span for f in pb.fields(old) if f.number != pb.CLAIM_STATUS
    ]

    cleared = pb.with_devices(new, ours, [])
    assert pb.status_device_keys(cleared) == [("net.example.com", "node-a", "eth1", "")]
    assert pb.with_devices(pb.with_devices(cleared, ours, []), ours, []) == cleared


def test_an_entry_is_encoded_as_the_apis_generated_code_reads_it():
    (field,) = pb.fields(pb.encode_device_status(our_entry("gpu-0")))
    assert field.number == pb.STATUS_DEVICES
    parts = {f.number: f for f in pb.fields(field.value)}
    assert pb.DEV_SHARE_ID not in parts  # a nil pointer in Go, not an empty share ID
    assert parts[pb.DEV_DEVICE].value == b"gpu-0"
    (raw,) = pb.fields(parts[pb.DEV_DATA].value)
    assert json.loads(raw.value) == {"kind": "timeslice", "timeSlice": {"interval": "Long"}} and b" " not in raw.value
    condition = {f.number: f.value for f in pb.fields(parts[pb.DEV_CONDITIONS].value)}
    assert condition[pb.COND_GENERATION] == 2 and condition[pb.COND_REASON] == b"Prepared"
    (seconds,) = pb.fields(condition[pb.COND_TIME])
    assert seconds.value == 1777863721  # 2026-05-04T03:02:01Z


def test_a_claim_without_status_gets_one_and_foreign_bytes_are_refused():
    bare = length_field(1, string_field(5, "u"))
    assert pb.status_device_keys(pb.with_devices(bare, ours, [our_entry("gpu-0")])) == [(DRIVER, "node-a", "gpu-0", "")]
    with pytest.raises(pb.ProtobufError):
        pb.unwrap(b'{"kind": "ResourceClaim"}')
    with pytest.raises(pb.ProtobufError):
        list(pb.fields(length_field(1, b"abc")[:-1]))  # truncated


@given(st.integers(min_value=-(2**63), max_value=2**64 - 1))
def test_varints_round_trip(value: int):
    decoded, end = pb._read_varint(pb.varint(value), 0)
    assert decoded == value % 2**64 and end == len(pb.varint(value))


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
