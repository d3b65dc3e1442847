"""A prepared claim whose devices a reboot or a GPU reset destroyed is made again, at start-up,
after the reset, or when kubelet prepares it again: never answered from the record alone."""

from __future__ import annotations

from pathlib import Path

import pynvml
import pytest

from driver.node.recovery import recover
from tests.support.prepare_again import LONG, claim, prepared, reboot, timeslice


@pytest.mark.root  # mounts MPS tmpfs
def test_start_up_after_a_reboot_makes_every_kind_again_before_kubelet_asks(node, tmp_path: Path):
    api, env = node
    refs = {
        "whole": claim(api, "whole", "gpu-0"),
        "mig": claim(api, "mig", "gpu-1-mig-1g10gb-6"),
        "mps": claim(api, "mps", "gpu-2-mps", memory="4Gi"),
        "ts": claim(api, "ts", "gpu-3-ts", config=[LONG], memory="4Gi"),
        "part-a": claim(api, "part-a", "gpu-4-mig-3g40gb-4-mps", memory="4Gi"),
        "part-b": claim(api, "part-b", "gpu-4-mig-3g40gb-4-mps", memory="8Gi"),
    }
    for ref in refs.values():
        prepared(env, api, ref)
    old_partition = env.claims.get(refs["part-a"].uid).devices[0].mig_uuid
    reboot(env, tmp_path)
    assert not env.mps.running(env.gpus[2].uuid) and env.session.compute_mode(2) == pynvml.NVML_COMPUTEMODE_DEFAULT

    restarted = env.restart(api)
    recover(restarted.preparer)

    assert set(restarted.cdi.claim_uids_on_disk()) == {ref.uid for ref in refs.values()}
    assert restarted.mps.running(env.gpus[2].uuid)
    assert env.session.compute_mode(2) == pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS
    assert timeslice(tmp_path, env.gpus[3].uuid) == 3
    [mig] = env.session.gpu_instances(1)
    assert env.claims.get(refs["mig"].uid).devices[0].mig_uuid == mig.compute_instances[0][1]
    [partition] = env.session.gpu_instances(4)
    new_partition = partition.compute_instances[0][1]
    assert new_partition != old_partition
    for name in ("part-a", "part-b"):  # both shares of the partition: one instance, its daemon, its mounts
        device = env.claims.get(refs[name].uid).devices[0]
        assert device.mig_uuid == new_partition
        assert device.mounts == restarted.mps.mounts(new_partition)
    assert restarted.mps.running(new_partition) and not restarted.mps.pipe_dir(old_partition).parent.exists()
    # Kubelet's prepare then finds everything in place.
    for ref in refs.values():
        assert restarted.preparer.prepare([ref])[ref.uid].devices == env.claims.get(ref.uid).devices
