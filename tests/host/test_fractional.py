"""MIG, MPS and time-sliced shares prepared by the driver over mock NVML and the fake tools."""

from __future__ import annotations

from pathlib import Path

import pynvml
import pytest

from driver.claims.refs import ClaimRef
from driver.node.recovery import recover
from partitioner import tmpfs
from testbed.fakes import allocated_claim, result
from tests.support.shares import CONFIG, claim, opaque, share, spec


@pytest.mark.root  # mounts an MPS tmpfs / uses kubelet's directories
@pytest.mark.parametrize("device", ["gpu-4-mps", "gpu-4-ts"])
def test_a_share_switches_off_the_mig_mode_a_mig_device_left_on(node, device: str):
    """Whole-GPU use needs MIG mode off; an H100 switches at once, so a share may follow MIG."""
    api, env = node
    mig = claim(api, "mig", [result("gpu-4-mig-1g10gb-0")])
    assert env.preparer.prepare([mig])[mig.uid].error == ""
    assert env.preparer.unprepare([mig]) == {mig.uid: ""}
    assert env.session.mig_enabled(4)  # unprepare leaves MIG mode as it is
    ref = claim(api, "share", [share(device, memory="1Gi")])
    assert env.preparer.prepare([ref])[ref.uid].error == ""
    assert not env.session.mig_enabled(4)
    assert env.preparer.unprepare([ref]) == {ref.uid: ""}


@pytest.mark.root  # mounts an MPS tmpfs / uses kubelet's directories
def test_mps_shares_share_one_daemon_with_their_own_limits(node):
    api, env = node
    first = claim(api, "a", [share("gpu-1-mps", memory="10Gi", compute="25")])
    second = claim(
        api,
        "b",
        [share("gpu-1-mps", memory="20Gi", compute="50")],
        config=[
            opaque(
                {
                    "apiVersion": CONFIG,
                    "kind": "ShareConfig",
                    "sharing": {"strategy": "MPS", "mps": {"activeThreadPercentage": 40}},
                }
            )
        ],
    )
    assert env.preparer.prepare([first, second]) == {
        first.uid: env.preparer.prepare([first])[first.uid],
        second.uid: env.preparer.prepare([second])[second.uid],
    }
    uuid = env.gpus[1].uuid
    assert env.mps.running(uuid)
    assert env.session.compute_mode(1) == pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS
    env_a = spec(env, first.uid)["devices"][0]["containerEdits"]["env"]
    env_b = spec(env, second.uid)["devices"][0]["containerEdits"]["env"]
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25" in env_a and "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=10240M" in env_a
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=40" in env_b and "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=20480M" in env_b
    for claim_uid in (first.uid, second.uid):
        mounts = spec(env, claim_uid)["devices"][0]["containerEdits"]["mounts"]
        assert [(m["hostPath"], m["containerPath"], m["options"]) for m in mounts] == [
            (str(env.mps.pipe_dir(uuid)), "/tmp/nvidia-mps", ["ro", "nosuid", "nodev", "bind"]),
            (str(env.mps.shm_dir(uuid)), "/dev/shm", ["rw", "nosuid", "nodev", "bind"]),
        ]
    # The container's /dev/shm is the tmpfs the daemon has as its /dev/shm: the daemon's file is there.
    assert (Path(mounts[1]["hostPath"]) / f"cuda.shm.fgpu-mps-{uuid}").exists()
    env.preparer.unprepare([first])
    assert env.mps.running(uuid)  # the other share still uses it
    assert tmpfs.is_mounted(env.mps.shm_dir(uuid))
    env.preparer.unprepare([second])
    assert not env.mps.running(uuid)
    assert env.session.compute_mode(1) == pynvml.NVML_COMPUTEMODE_DEFAULT
    assert not tmpfs.is_mounted(env.mps.shm_dir(uuid))
    assert not env.mps.pipe_dir(uuid).parent.exists()


@pytest.mark.root  # mounts an MPS tmpfs / uses kubelet's directories
def test_class_config_comes_before_claim_config(node):
    api, env = node
    base = {"apiVersion": CONFIG, "kind": "ShareConfig", "sharing": {"strategy": "MPS"}}
    from_class = opaque(
        {**base, "sharing": {"strategy": "MPS", "mps": {"activeThreadPercentage": 10}}}, source="FromClass"
    )
    from_claim = opaque({**base, "sharing": {"strategy": "MPS", "mps": {"activeThreadPercentage": 30}}})
    ref = claim(api, "cfg", [share("gpu-5-mps", memory="8Gi", compute="50")], config=[from_claim, from_class])
    env.preparer.prepare([ref])
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=30" in spec(env, ref.uid)["devices"][0]["containerEdits"]["env"]


@pytest.mark.root  # mounts an MPS tmpfs / uses kubelet's directories
def test_restart_sweeps_orphans_and_keeps_what_claims_own(node):
    api, env = node
    kept = claim(api, "kept", [result("gpu-6-mig-2g20gb-0"), share("gpu-7-mps", memory="4Gi", compute="10")])
    assert env.preparer.prepare([kept])[kept.uid].error == ""
    env.session.create_mig_instance(6, 9, 4, 4)  # made behind fgpu's back: no claim owns it
    env.cdi.write("uid-ghost", [])
    restarted = env.restart(api)
    recover(restarted.preparer)
    assert [(r.profile_id, r.start) for r in env.session.gpu_instances(6)] == [(14, 0)]
    assert env.cdi.claim_uids_on_disk() == {kept.uid}
    assert restarted.mps.running(env.gpus[7].uuid)
    assert restarted.preparer.prepare([kept])[kept.uid].error == ""


def admin(device: str) -> dict:
    entry = result(device, request="monitor")
    entry["adminAccess"] = True
    return entry


@pytest.mark.root  # mounts an MPS tmpfs / uses kubelet's directories
def test_admin_access_reaches_devices_in_use_without_making_changing_or_holding_anything(node):
    api, env = node
    uuid = env.gpus[1].uuid
    user = claim(api, "user", [share("gpu-1-mps", memory="10Gi", compute="25")])
    mig_user = claim(api, "mig-user", [result("gpu-2-mig-3g40gb-4")])
    monitor = claim(api, "monitor", [admin("gpu-1-mps"), admin("gpu-2-mig-3g40gb-4"), admin("gpu-3")])
    assert env.preparer.prepare([user, mig_user])[user.uid].error == ""
    instances = env.session.gpu_instances(2)

    outcome = env.preparer.prepare([monitor])[monitor.uid]
    assert outcome.error == "" and outcome.summary.count("admin access, nothing created") == 3
    edits = {d["name"]: d["containerEdits"] for d in spec(env, monitor.uid)["devices"]}
    assert [n["path"] for n in edits["uid-monitor-gpu-1-mps"]["deviceNodes"]] == ["/dev/nvidia1"]
    assert not [e for e in edits["uid-monitor-gpu-1-mps"].get("env", []) if e.startswith("CUDA_MPS")]
    assert env.session.gpu_instances(2) == instances  # the user's instance, nothing more
    assert not env.session.mig_enabled(3)  # a whole GPU: nothing switched

    env.preparer.unprepare([user])  # the monitor does not keep the user's MPS daemon
    assert not env.mps.running(uuid)
    assert env.preparer.unprepare([monitor]) == {monitor.uid: ""}
    assert env.session.gpu_instances(2) == instances  # the monitor's end destroys nothing of others
    env.preparer.unprepare([mig_user])
    assert env.session.gpu_instances(2) == []


@pytest.mark.root  # mounts an MPS tmpfs / uses kubelet's directories
def test_mps_shares_inside_a_mig_partition_share_its_daemon_and_the_last_destroys_it(node):
    api, env = node
    device = "gpu-3-mig-3g40gb-4-mps"
    first = claim(api, "a", [share(device, memory="10Gi", compute="25")])
    second = claim(api, "b", [share(device, memory="20Gi", compute="50")])
    outcome = env.preparer.prepare([first])[first.uid]
    assert outcome.error == "" and "MIG 3g.40gb gi" in outcome.summary and "daemon started" in outcome.summary
    [instance] = env.session.gpu_instances(3)
    assert (instance.profile_id, instance.start) == (9, 4)
    mig_uuid = instance.compute_instances[0][1]
    joined = env.preparer.prepare([second])[second.uid]
    assert joined.error == "" and "joined" in joined.summary and "daemon already running" in joined.summary
    assert len(env.session.gpu_instances(3)) == 1  # one partition, two shares
    assert env.mps.running(mig_uuid) and not env.mps.running(env.gpus[3].uuid)
    # The GPU's compute mode is the whole GPU's: a partition's daemon leaves it alone.
    assert env.session.compute_mode(3) == pynvml.NVML_COMPUTEMODE_DEFAULT
    for ref, memory, threads in ((first, "10240M", "25"), (second, "20480M", "50")):
        edits = spec(env, ref.uid)["devices"][0]["containerEdits"]
        assert f"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE={threads}" in edits["env"]
        assert f"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0={memory}" in edits["env"]
        assert edits["deviceNodes"][0]["path"] == "/dev/nvidia3" and len(edits["deviceNodes"]) == 3
        assert [m["hostPath"] for m in edits["mounts"]] == [
            str(env.mps.pipe_dir(mig_uuid)),
            str(env.mps.shm_dir(mig_uuid)),
        ]
    assert {d.mig_uuid for r in (first, second) for d in env.claims.get(r.uid).devices} == {mig_uuid}
    assert env.preparer.unprepare([first]) == {first.uid: ""}
    assert env.mps.running(mig_uuid) and len(env.session.gpu_instances(3)) == 1
    assert env.preparer.unprepare([second]) == {second.uid: ""}
    assert not env.mps.running(mig_uuid) and env.session.gpu_instances(3) == []
    assert not env.mps.pipe_dir(mig_uuid).parent.exists()


@pytest.mark.root  # mounts an MPS tmpfs / uses kubelet's directories
def test_restart_keeps_a_partitions_daemon_and_sweeps_an_orphaned_one(node):
    api, env = node
    kept = claim(api, "kept", [share("gpu-5-mig-3g40gb-4-mps", memory="4Gi")])
    gone = claim(api, "gone", [share("gpu-6-mig-3g40gb-0-mps", memory="4Gi")])
    assert env.preparer.prepare([kept, gone])[gone.uid].error == ""
    kept_uuid = env.claims.get(kept.uid).devices[0].mig_uuid
    gone_uuid = env.claims.get(gone.uid).devices[0].mig_uuid
    env.claims.commit(removed=[gone.uid])  # as if its unprepare were lost with the plugin
    restarted = env.restart(api)
    recover(restarted.preparer)
    assert restarted.mps.running(kept_uuid) and not restarted.mps.running(gone_uuid)
    assert env.session.gpu_instances(6) == [] and len(env.session.gpu_instances(5)) == 1
    assert restarted.preparer.unprepare([kept]) == {kept.uid: ""} and env.session.gpu_instances(5) == []


@pytest.mark.root  # mounts an MPS tmpfs / uses kubelet's directories
def test_another_namespace_never_meets_a_tenants_mps_daemon_or_its_dev_shm(node):
    """Findings 1, 3 and 4: one daemon (its control socket, /dev/shm and server uid) served every
    namespace on a GPU. Now a namespace's claim waits for the GPU's shares of another namespace to
    go, then gets a daemon and a /dev/shm of its own: nothing of the first tenant's is left."""
    api, env = node
    uuid = env.gpus[1].uuid
    api.claims[("team-a", "a")] = allocated_claim("team-a", "a", "uid-a", [share("gpu-1-mps", memory="4Gi")])
    api.claims[("team-b", "b")] = allocated_claim("team-b", "b", "uid-b", [share("gpu-1-mps", memory="4Gi")])
    first, second = ClaimRef("team-a", "a", "uid-a"), ClaimRef("team-b", "b", "uid-b")
    assert env.preparer.prepare([first])[first.uid].error == ""
    daemon = env.mps.daemon_pid(uuid)
    (env.mps.shm_dir(uuid) / "team-a-secret").write_text("weights")  # what team-a's clients leave in /dev/shm

    error = env.preparer.prepare([second])[second.uid].error
    assert "shared by another tenant's claims" in error and "team-a" not in error
    assert env.mps.daemon_pid(uuid) == daemon

    assert env.preparer.unprepare([first]) == {first.uid: ""}
    assert env.preparer.prepare([second])[second.uid].error == ""
    assert env.mps.daemon_pid(uuid) not in (None, daemon)  # a daemon of its own
    assert [p.name for p in env.mps.shm_dir(uuid).iterdir()] == [f"cuda.shm.fgpu-mps-{uuid}"]
    assert env.preparer.unprepare([second]) == {second.uid: ""}
