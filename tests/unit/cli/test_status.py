"""`fgpu status`'s core: the model from realistic slices (mock dgx-h100) and claims, and its renderings."""

from __future__ import annotations

import json
import uuid
from typing import Any

import yaml

from driver.cli.status import (
    ClusterStatus,
    GpuStatus,
    cluster_status,
    render_json,
    render_table,
    render_yaml,
    to_document,
)
from driver.inventory.discovery import discover_gpus
from driver.inventory.offers import node_inventory
from driver.inventory.sharing import SharingConfig
from driver.inventory.slices import build_slices
from driver.nvml.session import NvmlSession

DRIVER = "gpu.fgpu.dev"
INVENTORY = node_inventory(discover_gpus(NvmlSession.open("mock:dgx-h100")), SharingConfig())


def h100_slices(*nodes: str) -> list[dict[str, Any]]:
    return [s for node in nodes for s in build_slices(DRIVER, node, INVENTORY, generation=1, owner=None)]


def mig_devices(gpu: int) -> list[dict[str, Any]]:
    return [
        d for s in h100_slices("n1") for d in s["spec"].get("devices", []) if d["name"].startswith(f"gpu-{gpu}-mig-")
    ]


def result(device: str, request: str = "gpu", pool: str = "n1", driver: str = DRIVER, **share: Any) -> dict[str, Any]:
    """An allocation result; consumed capacity makes it a share with its own shareID."""
    body = {"request": request, "driver": driver, "pool": pool, "device": device}
    if share:
        body |= {"shareID": str(uuid.uuid4()), "consumedCapacity": share}
    return body


def claim(name: str, *results: dict[str, Any], pods: tuple[str, ...] = (), config: tuple = ()) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": "team", "uid": f"uid-{name}"},
        "status": {
            "allocation": {"devices": {"results": list(results), "config": list(config)}},
            "reservedFor": [{"resource": "pods", "name": pod, "uid": f"uid-{pod}"} for pod in pods],
        },
    }


def share_config(source: str = "FromClaim", **sharing: Any) -> dict[str, Any]:
    parameters = {"apiVersion": "gpu.fgpu.dev/v1alpha1", "kind": "ShareConfig", "sharing": sharing}
    return {"source": source, "requests": ["gpu"], "opaque": {"driver": DRIVER, "parameters": parameters}}


def gpus(status: ClusterStatus, node: str = "n1") -> dict[int, GpuStatus]:
    (found,) = [n for n in status.nodes if n.name == node]
    return {gpu.index: gpu for gpu in found.gpus}


def test_an_idle_node_offers_everything_on_every_gpu():
    status = cluster_status(h100_slices("n1", "n2"), [], DRIVER)
    assert [n.name for n in status.nodes] == ["n1", "n2"] and not status.unpublished
    gpu = gpus(status)[5]
    assert len(gpus(status)) == 8
    assert (gpu.state, gpu.whole_free, gpu.healthy, gpu.offers) == (
        "free",
        True,
        True,
        ["whole", "mig", "mps", "timeslice"],
    )
    assert gpu.product == "NVIDIA H100 80GB HBM3" and gpu.uuid.startswith("GPU-")
    assert {p.device for p in gpu.mig_placeable} == {d["name"] for d in mig_devices(5)}
    mps, ts = gpu.shares
    assert (mps.device, mps.open, mps.count, mps.free) == ("gpu-5-mps", True, 0, mps.capacity)
    assert mps.capacity == {"clients": "48", "compute": "100", "memory": "81408Mi"}
    assert (ts.kind, ts.open, ts.free) == ("timeslice", True, {"memory": "81408Mi"})


def test_a_whole_gpu_takes_everything_on_it_and_names_its_pods():
    status = cluster_status(h100_slices("n1"), [claim("train", result("gpu-0"), pods=("trainer",))], DRIVER)
    gpu = gpus(status)[0]
    assert (gpu.state, gpu.whole_free, gpu.mig_placeable) == ("full", False, [])
    assert not any(s.open for s in gpu.shares) and all(s.free == {} for s in gpu.shares)
    (held,) = gpu.claims
    assert (held.claim, held.device, held.kind, held.pods, held.share_id) == (
        "team/train",
        "gpu-0",
        "whole",
        ["team/trainer"],
        None,
    )
    assert gpus(status)[1].state == "free"


def test_mig_placements_left_follow_the_counters():
    first = claim("small", result("gpu-1-mig-1g10gb-0"))
    status = cluster_status(h100_slices("n1"), [first], DRIVER)
    gpu = gpus(status)[1]
    assert (gpu.state, gpu.whole_free) == ("partial", False)
    # Memory slice 0 is taken: every placement starting there is gone, the others all remain.
    expected = {d["name"] for d in mig_devices(1) if d["attributes"]["placementStart"]["int"] != 0}
    assert {p.device for p in gpu.mig_placeable} == expected
    assert not any(s.open for s in gpu.shares)  # a share needs the whole GPU
    (held,) = gpu.claims
    assert (held.kind, held.profile, held.placement_start, held.placement_size) == ("mig", "1g.10gb", 0, 1)

    # A +me profile draws the GPU's one media-extensions counter: no other +me placement is left.
    second = claim("media", result("gpu-1-mig-1g10gbme-1"))
    left = {p.device for p in gpus(cluster_status(h100_slices("n1"), [first, second], DRIVER))[1].mig_placeable}
    assert left == {d for d in expected if "gbme-" not in d and not d.endswith("-1")}


def test_mps_shares_leave_capacity_and_keep_the_gpu_from_other_kinds():
    shares = [
        claim("a", result("gpu-2-mps", memory="10Gi", compute="25", clients="1"), pods=("a-0",)),
        claim("b", result("gpu-2-mps", memory="2Gi", compute="5", clients="1")),
    ]
    gpu = gpus(cluster_status(h100_slices("n1"), shares, DRIVER))[2]
    mps, ts = gpu.shares
    assert (mps.count, mps.open) == (2, True)
    assert mps.free == {"clients": "46", "compute": "70", "memory": "69120Mi"}  # 79.5Gi less 12Gi
    assert (ts.open, ts.count, gpu.whole_free, gpu.mig_placeable, gpu.state) == (False, 0, False, [], "partial")
    assert [(h.claim, h.consumed_capacity["memory"], h.pods) for h in gpu.claims] == [
        ("team/a", "10Gi", ["team/a-0"]),
        ("team/b", "2Gi", []),
    ]
    assert all(h.kind == "mps" and h.share_id for h in gpu.claims)


def test_a_share_device_with_no_room_for_the_smallest_share_is_full():
    full = claim("all", result("gpu-2-mps", memory="1Gi", compute="100", clients="1"))
    gpu = gpus(cluster_status(h100_slices("n1"), [full], DRIVER))[2]
    assert (gpu.shares[0].open, gpu.shares[0].free, gpu.state) == (False, {}, "full")
    nearly = claim("most", result("gpu-2-mps", memory="1Gi", compute="95", clients="1"))
    gpu = gpus(cluster_status(h100_slices("n1"), [nearly], DRIVER))[2]
    assert (gpu.shares[0].free["compute"], gpu.state) == ("5", "partial")


def test_time_sliced_shares_show_the_interval_their_config_sets():
    short = claim(
        "short",
        result("gpu-4-ts", memory="1Gi"),
        config=(share_config("FromClass", strategy="TimeSlicing", timeSlicing={"interval": "Short"}),),
    )
    plain = claim("plain", result("gpu-4-ts", memory="3Gi"))
    # The interval is the whole GPU's: a claim's own config cannot change its class's (Default).
    bad = claim(
        "bad",
        result("gpu-4-ts", memory="1Gi"),
        config=(share_config(strategy="TimeSlicing", timeSlicing={"interval": "Short"}),),
    )
    gpu = gpus(cluster_status(h100_slices("n1"), [short, plain, bad], DRIVER))[4]
    assert [(h.claim, h.kind, h.interval) for h in gpu.claims] == [
        ("team/short", "timeslice", "Short"),
        ("team/plain", "timeslice", None),
        ("team/bad", "timeslice", None),
    ]
    assert "sharing.timeSlicing.interval Short differs from the device class's Default" in (
        gpu.claims[2].config_error or ""
    )
    assert gpu.shares[1].free == {"memory": "76288Mi"}  # 79.5Gi less 5Gi
    assert "timeslice memory 1Gi, interval Short" in render_table(cluster_status(h100_slices("n1"), [short], DRIVER))


def test_taints_are_shown_and_the_drivers_own_mean_unhealthy():
    slices = h100_slices("n1")
    for device in (d for s in slices for d in s["spec"].get("devices", [])):
        if device["name"].startswith("gpu-3"):
            device["taints"] = [{"key": "gpu.fgpu.dev/xid", "value": "79", "effect": "NoExecute"}]
        if device["name"] == "gpu-6":
            device["taints"] = [{"key": "example.com/maintenance", "effect": "NoSchedule"}]
    by_index = gpus(cluster_status(slices, [], DRIVER))
    (taint,) = by_index[3].taints
    assert (taint.key, taint.value, taint.effect, by_index[3].healthy) == ("gpu.fgpu.dev/xid", "79", "NoExecute", False)
    assert taint.devices[0] == "gpu-3" and len(taint.devices) == 2 + len(mig_devices(3)) + 1
    (maintenance,) = by_index[6].taints
    assert (maintenance.devices, by_index[6].healthy, by_index[5].taints) == (["gpu-6"], True, [])
    table = render_table(cluster_status(slices, [], DRIVER))
    taint_rows = [line.split() for line in table.splitlines()[table.splitlines().index("") + 1 :]]
    assert taint_rows == [
        ["NODE", "GPU", "TAINT", "DEVICES"],
        ["n1", "3", "gpu.fgpu.dev/xid=79:NoExecute", "gpu-3", "and", "27", "more"],
        ["n1", "6", "example.com/maintenance:NoSchedule", "gpu-6"],
    ]
    assert table.splitlines()[4].split()[6:8] == ["unhealthy", "free"]  # the product name is 4 words


def test_node_filter_unknown_nodes_and_devices_no_slice_publishes():
    claims = [
        claim("lost", result("gpu-9")),
        claim("elsewhere", result("gpu-0", pool="n3")),
        claim("other-driver", result("gpu-1", driver="other.example.com")),
    ]
    status = cluster_status(h100_slices("n1", "n2"), claims, DRIVER, nodes=["n1", "ghost"])
    assert [(n.name, n.problem, len(n.gpus)) for n in status.nodes] == [
        ("ghost", "publishes no gpu.fgpu.dev devices", 0),
        ("n1", None, 8),
    ]
    assert [(h.claim, h.device, h.kind) for h in status.unpublished] == [("team/lost", "gpu-9", None)]
    assert gpus(status)[1].state == "free"  # another driver's device of the same name is not ours
    every = cluster_status(h100_slices("n1", "n2"), claims, DRIVER)
    assert [h.claim for h in every.unpublished] == ["team/lost", "team/elsewhere"]


def test_a_pool_being_updated_is_named_and_its_claims_listed_as_unpublished():
    slices = h100_slices("n1")[:-1]  # one slice of the pool's generation is missing
    status = cluster_status(slices, [claim("a", result("gpu-0"))], DRIVER)
    (node,) = status.nodes
    assert (node.problem, node.gpus) == ("pool n1 is being updated", [])
    assert [h.claim for h in status.unpublished] == ["team/a"]
    assert "n1: pool n1 is being updated" in render_table(status)


def test_json_and_yaml_carry_the_documented_field_names():
    claims = [claim("a", result("gpu-2-mps", memory="1Gi", compute="10", clients="1"), pods=("p",))]
    status = cluster_status(h100_slices("n1"), claims, DRIVER)
    document = json.loads(render_json(status))
    assert document == yaml.safe_load(render_yaml(status)) == to_document(status)
    assert list(document) == ["nodes", "unpublished"]
    gpu = document["nodes"][0]["gpus"][2]
    assert list(gpu) == [
        "index", "uuid", "product", "healthy", "state", "offers", "notOffered", "wholeFree", "migPlaceable",
        "shares", "claims", "taints",
    ]  # fmt: skip
    assert list(gpu["claims"][0]) == [
        "claim", "request", "pool", "device", "kind", "profile", "placementStart", "placementSize", "shareID",
        "consumedCapacity", "interval", "configError", "pods",
    ]  # fmt: skip
    assert list(gpu["shares"][0]) == ["device", "kind", "count", "open", "capacity", "free"]
    assert list(document["nodes"][0]["gpus"][0]["migPlaceable"][0]) == ["device", "profile", "start", "size"]


def test_the_table_has_a_row_per_gpu_and_per_holding():
    claims = [
        claim("w", result("gpu-0"), pods=("w-0",)),
        claim("m", result("gpu-1-mig-3g40gb-4")),
        claim("s", result("gpu-2-mps", memory="10Gi", compute="25", clients="1")),
    ]
    lines = render_table(cluster_status(h100_slices("n1"), claims, DRIVER)).splitlines()
    assert lines[0].split() == ["NODE", "GPU", "PRODUCT", "HEALTH", "STATE", "FREE"]
    rows = {line.split()[1]: line for line in lines[1:9]}
    assert rows["0"].split()[-2:] == ["full", "-"]
    assert rows["1"].endswith(
        "partial  mig 1g.10gb@0,1,2,3 1g.10gb+me@0,1,2,3 1g.20gb@0,2 2g.20gb@0,2 3g.40gb@0 4g.40gb@0"
    )
    assert rows["2"].endswith("partial  mps clients 47, compute 75, memory 71168Mi")
    assert rows["7"].endswith("free     all: whole, mig, mps, timeslice")
    holdings = lines[lines.index("") + 1 :]
    assert holdings[0].split() == ["CLAIM", "NODE", "GPU", "DEVICE", "HOLDS", "PODS"]
    assert holdings[1].split() == ["team/w", "n1", "0", "gpu-0", "whole", "GPU", "team/w-0"]
    assert holdings[2].split() == ["team/m", "n1", "1", "gpu-1-mig-3g40gb-4", "mig", "3g.40gb", "at", "4", "-"]
    assert holdings[3].split()[4:] == ["mps", "memory", "10Gi,", "compute", "25,", "clients", "1", "-"]


def test_a_gpu_that_offers_less_says_why():
    a100 = node_inventory(discover_gpus(NvmlSession.open("mock:dgx-a100-40gb")), SharingConfig())
    status = cluster_status(build_slices(DRIVER, "a1", a100, generation=1, owner=None), [], DRIVER)
    gpu = gpus(status, "a1")[0]
    assert gpu.offers == ["whole", "mps", "timeslice"]
    assert gpu.not_offered == "mig: MIG mode off, switching needs a GPU reset"
    assert "a1 GPU 0 offers no mig: MIG mode off, switching needs a GPU reset" in render_table(status).splitlines()
    # A GPU that offers all it is configured to: nothing to say.
    h100 = cluster_status(h100_slices("n1"), [], DRIVER)
    assert gpus(h100)[0].not_offered is None and "offers no" not in render_table(h100)
