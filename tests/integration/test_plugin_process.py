"""`fgpu kubelet-plugin` as a real process on real sockets, driven as kubelet drives it, with the
real kube-apiserver behind it."""

from __future__ import annotations

import json
import shutil
import signal
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from testbed.claims_api import create_claim
from testbed.plugin_process import PluginUnderTest
from testbed.workloads import wait_for
from tests.support.pools import complete_pool

pytestmark = pytest.mark.cluster


def test_registration_handshake_and_health(start_plugin):
    plugin = start_plugin()
    info = plugin.register()
    assert info.type == "DRAPlugin"
    assert info.name == "gpu.fgpu.dev"
    assert info.endpoint == str(plugin.dra_socket)
    assert list(info.supported_versions) == [
        "v1.DRAPlugin",
        "v1beta1.DRAPlugin",
        "v1.DRAResourceHealth",
        "v1alpha1.DRAResourceHealth",
    ]
    with grpc.insecure_channel(f"unix://{plugin.dra_socket}") as channel:
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status
    assert status == health_pb2.HealthCheckResponse.SERVING


def test_slices_are_accepted_by_the_apiserver_and_come_back(start_plugin, resource_api):
    start_plugin(node="node-b")
    slices = wait_for(lambda: complete_pool(resource_api, "node-b"))
    assert len(slices) == 5
    counters = [s for s in slices if s.spec.shared_counters]
    assert len(counters) == 1 and len(counters[0].spec.shared_counters) == 8
    devices = {d.name: d for s in slices for d in s.spec.devices or []}
    assert len(devices) == 8 * 28
    assert devices["gpu-0"].attributes["productName"].string == "NVIDIA H100 80GB HBM3"
    # The standard topology attributes, on every device of a GPU (the mock machine's own /sys).
    gpu_5 = [d.attributes for name, d in devices.items() if name.startswith("gpu-5")]
    topology = {(a["resource.kubernetes.io/pcieRoot"].string, a["resource.kubernetes.io/numaNode"].int) for a in gpu_5}
    assert topology == {("pci0000:55", 1)}
    assert devices["gpu-3-mig-2g20gb-4"].consumes_counters[0].counter_set == "gpu-3-counters"
    assert devices["gpu-3-mps"].allow_multiple_allocations
    assert all(s.metadata.owner_references[0].kind == "Node" for s in slices)
    generation = slices[0].spec.pool.generation
    resource_api.delete_collection_resource_slice(field_selector="spec.nodeName=node-b")  # as kubelet does
    restored = wait_for(lambda: complete_pool(resource_api, "node-b"))
    assert restored[0].spec.pool.generation >= generation


def test_prepare_unprepare_restart_repeat(start_plugin, resource_api):
    plugin = start_plugin()
    plugin.register()
    claim = create_claim(resource_api, devices=[("gpu", "gpu-2"), ("extra", "gpu-6")])
    first = plugin.prepare([claim])[claim["uid"]]
    assert first.error == ""
    devices = {d.device_name: (list(d.request_names), list(d.cdi_device_ids)) for d in first.devices}
    assert devices == {
        "gpu-2": (["gpu"], [f"k8s.gpu.fgpu.dev/claim={claim['uid']}-gpu-2"]),
        "gpu-6": (["extra"], [f"k8s.gpu.fgpu.dev/claim={claim['uid']}-gpu-6"]),
    }
    spec_path = plugin.cdi_dir / f"k8s.gpu.fgpu.dev-claim_{claim['uid']}.json"
    spec = json.loads(spec_path.read_text())
    assert {d["name"] for d in spec["devices"]} == {f"{claim['uid']}-gpu-2", f"{claim['uid']}-gpu-6"}

    assert plugin.prepare([claim])[claim["uid"]] == first  # idempotent
    assert plugin.prepare([claim], version="v1beta1")[claim["uid"]].devices[0].device_name == "gpu-2"

    assert plugin.stop() == 0
    assert not plugin.dra_socket.exists() and not plugin.registration_socket.exists()
    assert (plugin.plugin_dir / "checkpoint.json").exists()
    plugin.start()
    plugin.register()
    assert plugin.prepare([claim])[claim["uid"]] == first  # answered for a claim prepared before

    assert plugin.unprepare([claim]) == {claim["uid"]: ""}
    assert not spec_path.exists()
    assert plugin.unprepare([claim]) == {claim["uid"]: ""}
    again = plugin.prepare([claim])[claim["uid"]]
    assert again == first


def test_bad_claims_get_their_own_errors(start_plugin, resource_api):
    plugin = start_plugin()
    good = create_claim(resource_api, devices=[("gpu", "gpu-1")])
    unallocated = create_claim(resource_api)
    other_node = create_claim(resource_api, devices=[("gpu", "gpu-1")], pool="node-b")
    other_driver = create_claim(resource_api, devices=[("gpu", "gpu-1")], driver="gpu.nvidia.com")
    unknown_device = create_claim(resource_api, devices=[("gpu", "gpu-42")])
    wrong_uid = {
        **create_claim(resource_api, devices=[("gpu", "gpu-3")]),
        "uid": "0f0f0f0f-dead-beef-0000-000000000000",
    }
    missing = {"namespace": "default", "name": "no-such-claim", "uid": "11111111-2222-3333-4444-555555555555"}
    batch = [good, unallocated, other_node, other_driver, unknown_device, wrong_uid, missing]
    results = plugin.prepare(batch)
    assert set(results) == {c["uid"] for c in batch}
    assert results[good["uid"]].error == ""
    reasons = {
        unallocated["uid"]: "not allocated",
        other_node["uid"]: "not this node's pool",
        other_driver["uid"]: "no device of driver gpu.fgpu.dev",
        unknown_device["uid"]: "'gpu-42' is not a device",
        wrong_uid["uid"]: "UID mismatch",
        missing["uid"]: "does not exist",
    }
    for uid, reason in reasons.items():
        assert reason in results[uid].error, results[uid].error
    on_disk = {p.name for p in plugin.cdi_dir.glob("*.json")}
    assert on_disk == {f"k8s.gpu.fgpu.dev-claim_{good['uid']}.json"}
    checkpoint = json.loads((plugin.plugin_dir / "checkpoint.json").read_text())
    assert set(checkpoint["claims"]) == {good["uid"]}


def test_unknown_claim_unprepare_removes_nothing_else(start_plugin, resource_api):
    plugin = start_plugin()
    kept = create_claim(resource_api, devices=[("gpu", "gpu-4")])
    plugin.prepare([kept])
    ghost = {"namespace": "default", "name": "ghost", "uid": "99999999-0000-0000-0000-000000000000"}
    assert plugin.unprepare([ghost]) == {ghost["uid"]: ""}
    assert (plugin.cdi_dir / f"k8s.gpu.fgpu.dev-claim_{kept['uid']}.json").exists()


def test_unreachable_api_server_is_not_a_crash_loop(tmp_path, cluster):
    dead = tmp_path / "dead.kubeconfig"
    config = json.loads(cluster.kubeconfig.read_text())
    config["clusters"][0]["cluster"]["server"] = "https://127.0.0.1:1"  # nothing listens there
    dead.write_text(json.dumps(config))
    plugin = PluginUnderTest(node="node-a", kubeconfig=str(dead)).start()
    try:
        claim = {"namespace": "default", "name": "c", "uid": "aaaaaaaa-0000-0000-0000-000000000000"}
        result = plugin.prepare([claim])[claim["uid"]]
        assert "cannot read the claim from the API server" in result.error
        time.sleep(1.5)
        assert plugin.process.poll() is None
        assert "retrying" in plugin.logs()
    finally:
        plugin.stop()
        shutil.rmtree(plugin.root, ignore_errors=True)


def test_stale_sockets_are_replaced_and_sigterm_keeps_state(start_plugin, resource_api):
    plugin = start_plugin()
    claim = create_claim(resource_api, devices=[("gpu", "gpu-0")])
    plugin.prepare([claim])
    plugin.stop(signal.SIGKILL)  # leaves its sockets behind
    assert plugin.dra_socket.exists()
    plugin.start()
    plugin.register()
    assert plugin.prepare([claim])[claim["uid"]].error == ""


def test_missed_unprepare_is_reconciled(start_plugin, resource_api):
    plugin = start_plugin(extra_args=["--unprepare-grace=1", "--reconcile-interval=0.3"])
    claim = create_claim(resource_api, devices=[("gpu", "gpu-5")])
    kept = create_claim(resource_api, devices=[("gpu", "gpu-6")])
    plugin.prepare([claim, kept])
    resource_api.delete_namespaced_resource_claim(claim["name"], "default")  # and kubelet never calls
    spec = plugin.cdi_dir / f"k8s.gpu.fgpu.dev-claim_{claim['uid']}.json"
    wait_for(lambda: not spec.exists(), timeout=60)  # generous: a loaded CI machine
    checkpoint = json.loads((plugin.plugin_dir / "checkpoint.json").read_text())
    assert set(checkpoint["claims"]) == {kept["uid"]}
    assert "is gone from the API server" in plugin.logs()
