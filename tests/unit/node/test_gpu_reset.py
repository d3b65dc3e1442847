"""A GPU reset under prepared claims: the health monitor sees a lost GPU come back, a reconciler
pass sees an admin's reset of a healthy one (its claims' MIG instances gone); either way that GPU's
claims are made again before kubelet asks."""

from __future__ import annotations

from pathlib import Path

from driver.claims.refs import ClaimRef
from driver.node.health.monitor import HealthBoard, HealthMonitor
from driver.node.health.record import HealthRecord
from driver.node.health.taints import HealthPolicy
from driver.node.reconcile import ClaimReconciler
from testbed.fakes import allocated_claim, result


def prepare(api, env, name: str, device: str) -> ClaimRef:
    api.claims[("default", name)] = allocated_claim("default", name, f"uid-{name}", [result(device)])
    ref = ClaimRef("default", name, f"uid-{name}")
    assert env.preparer.prepare([ref])[ref.uid].error == ""
    return ref


def mig_uuid(env, ref: ClaimRef) -> str:
    return env.claims.get(ref.uid).devices[0].mig_uuid


def test_a_lost_gpu_back_after_its_reset_gets_its_claims_made_again(node, tmp_path: Path):
    api, env = node
    ref = prepare(api, env, "mig", "gpu-2-mig-1g10gb-3")
    before = mig_uuid(env, ref)
    came_back: list[int] = []

    def on_gpu_back(index: int) -> None:
        came_back.append(index)
        env.preparer.check_prepared(index)

    monitor = HealthMonitor(
        env.session, env.gpus, list(env.preparer.targets.values()), HealthRecord(tmp_path / "health"),
        HealthPolicy(), lambda taints: None, HealthBoard(), lambda gpu, gi: None, on_gpu_back=on_gpu_back,
    )  # fmt: skip
    env.session.nvml.set_gpu_lost(2, True)  # XID 79: off the bus
    monitor._probe()
    # A claim on the lost GPU cannot be checked: a clear error, the claim released, not an internal one.
    assert came_back == []
    env.session.nvml.reset_gpu(2)  # the driver's recovery, or nvidia-smi -r
    monitor._probe()
    assert came_back == [2]
    [record] = env.session.gpu_instances(2)
    assert (record.profile_id, record.start) == (19, 3)
    assert mig_uuid(env, ref) == record.compute_instances[0][1] != before
    monitor._probe()
    assert came_back == [2]  # once per reset


def test_a_reconciler_pass_finds_an_admins_reset_of_a_healthy_gpu(node):
    api, env = node
    on_reset = prepare(api, env, "reset", "gpu-4-mig-3g40gb-4")
    elsewhere = prepare(api, env, "elsewhere", "gpu-5-mig-3g40gb-4")
    kept = mig_uuid(env, elsewhere)
    reconciler = ClaimReconciler(api, env.preparer, env.claims)
    assert env.preparer.prepare_again.gpus_missing_partitions() == set()
    env.session.nvml.reset_gpu(4)
    assert env.preparer.prepare_again.gpus_missing_partitions() == {4}
    reconciler.reconcile_once()
    assert env.preparer.prepare_again.gpus_missing_partitions() == set()
    assert mig_uuid(env, on_reset) == env.session.gpu_instances(4)[0].compute_instances[0][1]
    assert mig_uuid(env, elsewhere) == kept


def test_a_claim_on_a_gpu_that_does_not_answer_fails_clearly(node):
    api, env = node
    ref = prepare(api, env, "lost", "gpu-6-mig-1g10gb-0")
    env.session.nvml.set_gpu_lost(6, True)
    error = env.preparer.prepare([ref])[ref.uid].error
    assert "claim default/lost (uid uid-lost)" in error and "GPU 6" in error and "does not answer NVML" in error
    assert "internal error" not in error
