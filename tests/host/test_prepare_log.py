"""Each prepare and unprepare is one INFO line an operator can follow: the claim, its devices, what
was created or destroyed on them, and how long it took."""

from __future__ import annotations

import logging
import re

import pytest

from driver.claims.refs import ClaimRef
from testbed.fakes import allocated_claim, result

CONFIG = "gpu.fgpu.dev/v1alpha1"
TIMESLICE_LONG = {  # the class's: only a class sets the interval
    "source": "FromClass",
    "requests": ["ts"],
    "opaque": {
        "driver": "gpu.fgpu.dev",
        "parameters": {
            "apiVersion": CONFIG,
            "kind": "ShareConfig",
            "sharing": {"strategy": "TimeSlicing", "timeSlicing": {"interval": "Long"}},
        },
    },
}


def info_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    caplog.clear()
    return lines


@pytest.mark.root  # mounts an MPS tmpfs / uses kubelet's directories
def test_prepare_and_unprepare_each_log_one_line_with_what_changed(node, caplog: pytest.LogCaptureFixture):
    api, env = node
    results = [
        result("gpu-0", request="whole"),
        result("gpu-1-mig-3g40gb-4", request="mig"),
        {**result("gpu-2-mps", request="mps"), "consumedCapacity": {"memory": "8Gi", "compute": "20"}},
        {**result("gpu-3-ts", request="ts"), "consumedCapacity": {"memory": "4Gi"}},
    ]
    api.claims[("team-a", "mixed")] = allocated_claim("team-a", "mixed", "uid-mixed", results, [TIMESLICE_LONG])
    ref = ClaimRef("team-a", "mixed", "uid-mixed")
    caplog.set_level(logging.DEBUG)

    assert env.preparer.prepare([ref])["uid-mixed"].error == ""
    (line,) = info_lines(caplog)
    gi = env.session.gpu_instances(1)[0].gi_id
    assert re.fullmatch(
        r"prepared claim team-a/mixed \(uid uid-mixed\) in \d+ ms: "
        r"gpu-0: none; "
        rf"gpu-1-mig-3g40gb-4: MIG 3g\.40gb gi {gi} ci 0, MIG mode enabled; "
        r"gpu-2-mps: MPS share 20% threads, 8192Mi pinned memory, daemon started; "
        r"gpu-3-ts: timeslice Long",
        line,
    ), line

    assert env.preparer.prepare([ref])["uid-mixed"].error == ""  # kubelet's retry: nothing new
    (line,) = info_lines(caplog)
    assert line.endswith(
        f"already prepared, checked: gpu-0: none; gpu-1-mig-3g40gb-4: MIG 3g.40gb gi {gi} ci 0 in place; "
        "gpu-2-mps: MPS share 20% threads, 8192Mi pinned memory, daemon already running; gpu-3-ts: timeslice Long"
    ), line  # the interval is set again: it cannot be read back

    assert env.preparer.unprepare([ref]) == {"uid-mixed": ""}
    (line,) = info_lines(caplog)
    assert re.fullmatch(
        r"unprepared claim team-a/mixed \(uid uid-mixed\) in \d+ ms: "
        r"gpu-0: none; "
        rf"gpu-1-mig-3g40gb-4: MIG 3g\.40gb gi {gi} ci 0 destroyed; "
        r"gpu-2-mps: MPS share 20% threads, 8192Mi pinned memory ended, daemon stopped, its tmpfs unmounted; "
        r"gpu-3-ts: timeslice reset to Default",
        line,
    ), line


@pytest.mark.root  # mounts an MPS tmpfs / uses kubelet's directories
def test_a_share_that_others_still_use_says_so(node, caplog: pytest.LogCaptureFixture):
    api, env = node
    refs = []
    for name in ("first", "second"):
        share = {**result("gpu-5-mps"), "shareID": name, "consumedCapacity": {"memory": "2Gi", "compute": "10"}}
        api.claims[("default", name)] = allocated_claim("default", name, f"uid-{name}", [share])
        refs.append(ClaimRef("default", name, f"uid-{name}"))
    env.preparer.prepare(refs[:1])
    caplog.set_level(logging.INFO)
    env.preparer.prepare(refs[1:])
    assert info_lines(caplog)[0].endswith(
        "gpu-5-mps: MPS share 10% threads, 2048Mi pinned memory, daemon already running"
    )
    env.preparer.unprepare(refs[:1])
    assert info_lines(caplog)[0].endswith("daemon kept for other shares")
    env.preparer.unprepare([ClaimRef("default", "ghost", "uid-ghost")])
    (line,) = info_lines(caplog)
    assert re.fullmatch(
        r"unprepared claim default/ghost \(uid uid-ghost\) in \d+ ms: not prepared on this node, nothing destroyed",
        line,
    ), line
