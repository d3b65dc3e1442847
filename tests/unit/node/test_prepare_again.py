"""A prepared claim whose devices a reboot or a GPU reset destroyed is made again, at start-up,
after the reset, or when kubelet prepares it again: never answered from the record alone."""

from __future__ import annotations

import json
from pathlib import Path

from driver.nvml.mock_driver_root import forget_timeslices
from testbed.fakes import result
from testbed.node_env import NodeEnv
from tests.support.prepare_again import LONG, claim, prepared, reboot, timeslice


def device_nodes(env: NodeEnv, uid: str) -> list[str]:
    spec = json.loads(env.cdi.spec_path(uid).read_text())
    return [n["path"] for n in spec["devices"][0]["containerEdits"]["deviceNodes"]]


def test_after_a_reboot_a_mig_device_is_made_again_and_never_shares_a_new_claims_instance(node, tmp_path: Path):
    """The bug of NVIDIA's driver #951: answered from the record, the rebooted claim would get the
    capability device nodes of gi 1, which the mock (as NVIDIA's driver) hands to the next claim."""
    api, env = node
    old = claim(api, "old", "gpu-1-mig-1g10gb-6")
    before = prepared(env, api, old).devices[0]
    assert before.mig_gi_id == 1
    reboot(env, tmp_path)
    newcomer = claim(api, "new", "gpu-1-mig-1g10gb-0")  # prepared first after the reboot: it gets gi 1
    assert prepared(env, api, newcomer).devices[0].mig_gi_id == 1

    again = env.preparer.prepare([old])[old.uid]
    assert again.error == ""
    assert "made again (was " in again.summary
    [device] = again.devices
    instances = {(r.profile_id, r.start): r for r in env.session.gpu_instances(1)}
    record = instances[(before.mig_profile_id, 6)]
    assert device.mig_uuid == record.compute_instances[0][1] != before.mig_uuid
    assert device.mig_gi_id == record.gi_id != 1
    assert env.claims.get(old.uid).devices == (device,)  # the record follows
    caps_old, caps_new = set(device_nodes(env, old.uid)[1:]), set(device_nodes(env, newcomer.uid)[1:])
    assert caps_old and not caps_old & caps_new  # no capability of the newcomer's instance
    status = api.claims[("default", "old")]["status"]["devices"][0]["data"]["mig"]
    assert (status["uuid"], status["gpuInstanceID"]) == (device.mig_uuid, device.mig_gi_id)

    unchanged = env.preparer.prepare([old])[old.uid]
    assert unchanged.devices == again.devices and "in place" in unchanged.summary


def test_after_a_reboot_the_time_slice_interval_is_set_again(node, tmp_path: Path):
    api, env = node
    ref = claim(api, "ts", "gpu-3-ts", config=[LONG], memory="4Gi")
    other = claim(api, "ts2", "gpu-3-ts", config=[LONG], memory="4Gi")
    prepared(env, api, ref)
    prepared(env, api, other)
    uuid = env.gpus[3].uuid
    assert timeslice(tmp_path, uuid) == 3
    reboot(env, tmp_path)
    assert timeslice(tmp_path, uuid) == 0
    # The other claim's record says Long is set: only the GPU can say so, and it cannot be read back.
    again = env.preparer.prepare([ref])[ref.uid]
    assert again.error == "" and "timeslice Long" in again.summary
    assert timeslice(tmp_path, uuid) == 3
    assert env.cdi.spec_path(ref.uid).exists()


def test_a_placement_taken_meanwhile_is_a_clear_error_and_leaves_nothing(node, tmp_path: Path):
    api, env = node
    ref = claim(api, "mig", "gpu-2-mig-3g40gb-4")
    prepared(env, api, ref)
    reboot(env, tmp_path)
    foreign = env.session.create_mig_instance(2, 14, 4, 2)  # a 2g.20gb of someone else's on slices 4-5
    outcome = env.preparer.prepare([ref])[ref.uid]
    assert "claim default/mig (uid uid-mig)" in outcome.error
    assert "cannot be made again" in outcome.error and "placement 4 on GPU 2" in outcome.error
    assert env.claims.get(ref.uid) is None and not env.cdi.spec_path(ref.uid).exists()
    assert env.session.gpu_instances(2) == [foreign]  # theirs untouched, nothing of ours left
    assert "devices" not in api.claims[("default", "mig")].get("status", {})
    env.session.destroy_mig_instance(2, foreign.gi_id)
    assert env.preparer.prepare([ref])[ref.uid].error == ""  # kubelet's retry prepares it afresh


def test_a_gpu_reset_makes_that_gpus_claims_again_and_leaves_the_others(node, tmp_path: Path):
    api, env = node
    on_reset = claim(api, "reset", "gpu-5-mig-3g40gb-0")
    elsewhere = claim(api, "elsewhere", "gpu-6-mig-3g40gb-0")
    before = prepared(env, api, on_reset).devices[0]
    kept = prepared(env, api, elsewhere).devices[0]
    env.session.nvml.reset_gpu(5)
    forget_timeslices(tmp_path / "fake-smi.json", {env.gpus[5].uuid})
    assert env.session.gpu_instances(5) == []
    results = env.preparer.check_prepared(gpu_index=5)
    assert set(results) == {on_reset.uid} and results[on_reset.uid].error == ""
    [record] = env.session.gpu_instances(5)
    assert (record.profile_id, record.start) == (before.mig_profile_id, before.mig_start)
    assert env.claims.get(on_reset.uid).devices[0].mig_uuid == record.compute_instances[0][1] != before.mig_uuid
    assert env.claims.get(elsewhere.uid).devices[0] == kept


def test_a_failed_check_of_a_claim_whose_devices_are_all_there_keeps_it(node, tmp_path: Path):
    """Its containers may be using them: a tool that fails once is no reason to destroy them."""
    api, env = node
    ref = claim(api, "both", "gpu-5-mig-3g40gb-4")
    api.claims[("default", "both")]["status"]["allocation"]["devices"]["results"].append(
        {**result("gpu-6-ts"), "shareID": "share-both", "consumedCapacity": {"memory": "4Gi"}}
    )
    api.claims[("default", "both")]["status"]["allocation"]["devices"]["config"] = [LONG]
    before = prepared(env, api, ref).devices
    smi = tmp_path / "driver-root" / "usr" / "bin" / "nvidia-smi"
    smi.chmod(0o644)  # the tool cannot run for a moment
    outcome = env.preparer.prepare([ref])[ref.uid]
    assert "checking what it was prepared with failed" in outcome.error and "kept as it is" in outcome.error
    assert env.claims.get(ref.uid).devices == before and len(env.session.gpu_instances(5)) == 1
    smi.chmod(0o755)
    assert env.preparer.prepare([ref])[ref.uid].devices == before
