"""Bad input, as a new user gives it: every command refuses it with one line on stderr that names the
input, exits 2, and leaves nothing behind (no directory made, no file written)."""

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.cli import KUBECONFIG

INPUTS = {
    "kubeconfig": KUBECONFIG,
    "not-yaml.yaml": "not: [yaml",
    "string.yaml": "just a string\n",
    "empty.yaml": "",
    "no-context.yaml": "apiVersion: v1\nkind: Config\n",
    "file": "a file, not a directory\n",
    "gpu-9.yaml": "gpus: [{index: 9, offer: [mps]}]\n",
    "gpu-0-mig.yaml": "gpus: [{index: 0, offer: [mig]}]\n",
    "gpus-not-list.yaml": "gpus: 3\n",
    "offer-not-list.yaml": "offer: 5\n",
    "index-bool.yaml": "gpus: [{index: true, offer: [mps]}]\n",
    "no-metadata.yaml": "kind: ResourceClaim\nspec: {}\n",
    "list-of-numbers.yaml": "kind: List\nitems: [1, 2]\n",
    "class.yaml": "kind: DeviceClass\nmetadata: {name: gpu}\n",
    "pod-no-template.yaml": "kind: Pod\nmetadata: {name: p}\nspec: {resourceClaims: [{name: gpu, "
    "resourceClaimTemplateName: t}]}\n",
    "pod-claim-neither.yaml": "kind: Pod\nmetadata: {name: p}\nspec: {resourceClaims: [{name: gpu}]}\n",
    "deployment-replicas.yaml": "kind: Deployment\nmetadata: {name: d}\nspec: {replicas: two, template: {spec: {}}}\n",
    "mig-profiles-number.yaml": "migShareProfiles: 3\n",
}
PLUGIN = [
    "kubelet-plugin",
    "--node-name=n1",
    "--nvml=mock:l4x4",
    "--kubeconfig={in}/kubeconfig",
    "--plugin-dir={out}/plugin",
    "--registrar-dir={out}/registrar",
    "--cdi-dir={out}/cdi",
    "--state-dir={out}/state",
]
DISCOVER = ["discover", "--node-name=n1", "--nvml=mock:l4x4"]
WEBHOOK = ["webhook", "--tls-cert-file={in}/file", "--tls-private-key-file={in}/file"]
PLAN = ["plan", "--classes={in}/class.yaml", "--claims={in}/class.yaml", "--slices"]
NOT_A_DIR = "{in}/file is not a directory; give a directory path"
KUBECONFIG_ERROR = "cannot load the Kubernetes client configuration from {in}/"

# (name, arguments, environment, text the one line holds); {in}: the inputs, {out}: must stay empty.
CASES = [
    (
        "kubeconfig not YAML",
        [*PLUGIN, "--kubeconfig={in}/not-yaml.yaml"],
        {},
        KUBECONFIG_ERROR + "not-yaml.yaml: {in}/not-yaml.yaml is not valid YAML: expected ',' or ']'",
    ),
    ("kubeconfig a string", [*PLUGIN, "--kubeconfig={in}/string.yaml"], {}, "string.yaml is not a kubeconfig"),
    ("kubeconfig empty", [*PLUGIN, "--kubeconfig={in}/empty.yaml"], {}, "empty.yaml file is empty"),
    ("kubeconfig without context", [*PLUGIN, "--kubeconfig={in}/no-context.yaml"], {}, "Expected key current-context"),
    ("kubeconfig missing", [*PLUGIN, "--kubeconfig={in}/missing"], {}, KUBECONFIG_ERROR + "missing: no such file"),
    ("kubeconfig a directory", [*PLUGIN, "--kubeconfig={in}"], {}, "cannot read {in}: Is a directory"),
    ("state dir under a file", [*PLUGIN, "--state-dir={in}/file/x"], {}, "--state-dir {in}/file/x: " + NOT_A_DIR),
    ("cdi dir under a file", [*PLUGIN, "--cdi-dir={in}/file/x"], {}, "--cdi-dir {in}/file/x: " + NOT_A_DIR),
    ("plugin dir a file", [*PLUGIN, "--plugin-dir={in}/file"], {}, "--plugin-dir {in}/file: " + NOT_A_DIR),
    ("registrar dir under a file", [*PLUGIN, "--registrar-dir={in}/file/x"], {}, "--registrar-dir {in}/file/x: "),
    (
        "env seconds not a number",
        PLUGIN,
        {"UNPREPARE_GRACE": "abc"},
        "fgpu kubelet-plugin: argument --unprepare-grace: UNPREPARE_GRACE='abc' is not a number of seconds (0 or more)",
    ),
    ("flag seconds negative", [*PLUGIN, "--registration-grace=-1"], {}, "--registration-grace: '-1' is not a number"),
    ("flag seconds not finite", [*PLUGIN, "--shutdown-drain=nan"], {}, "--shutdown-drain: 'nan' is not a number"),
    (
        "env interval zero",
        PLUGIN,
        {"RECONCILE_INTERVAL": "0"},
        "RECONCILE_INTERVAL='0' is not a number of seconds above 0",
    ),
    ("env recovery garbage", PLUGIN, {"HEALTH_RECOVERY": "soon"}, "--health-recovery: HEALTH_RECOVERY='soon' is not"),
    (
        "env port too large",
        PLUGIN,
        {"HEALTHCHECK_PORT": "70000"},
        "HEALTHCHECK_PORT='70000' is not a port (0-65535, or -1: off)",
    ),
    ("flag port negative", [*PLUGIN, "--metrics-port=-5"], {}, "--metrics-port: '-5' is not a port"),
    ("env size garbage", PLUGIN, {"MPS_SHM_SIZE": "lots"}, "--mps-shm-size MPS_SHM_SIZE='lots' is not a size"),
    ("flag size too small", [*PLUGIN, "--mps-shm-size=1k"], {}, "--mps-shm-size '1k' is less than 1Mi"),
    (
        "flag xids garbage",
        [*PLUGIN, "--health-fault-xids=79,x"],
        {},
        "--health-fault-xids '79,x' is not a list of numbers",
    ),
    (
        "env effect not a choice",
        PLUGIN,
        {"HEALTH_FAULT_EFFECT": "Sometimes"},
        "--health-fault-effect: HEALTH_FAULT_EFFECT='Sometimes' is not one of NoSchedule, NoExecute, None",
    ),
    (
        "env boolean not a boolean",
        PLUGIN,
        {"HEALTH_MONITOR": "yes"},
        "--health-monitor: HEALTH_MONITOR='yes' is not true or false",
    ),
    ("env feature gates garbage", PLUGIN, {"FEATURE_GATES": "Faster=true"}, "--feature-gates: unknown gate 'Faster'"),
    (
        "feature gates leave nothing",
        [*PLUGIN, "--offer=mps", "--feature-gates=ConsumableCapacity=false"],
        {},
        "every GPU offers only mps, which the disabled gate(s) rule out",
    ),
    ("node name invalid", [*PLUGIN, "--node-name=Node_1"], {}, "--node-name 'Node_1' is not a node name"),
    ("pod uid invalid", [*PLUGIN, "--rolling-update-uid=a/b"], {}, "--rolling-update-uid 'a/b' is not a pod UID"),
    (
        "offer mig without MIG",
        [*PLUGIN, "--offer=mig"],
        {},
        "GPU(s) 0, 1, 2, 3 would offer no device: NVIDIA L4 cannot offer mig, only mps, timeslice, whole",
    ),
    ("offer unknown kind", [*PLUGIN, "--offer=whole,vgpu"], {}, "--offer: unknown kind(s) ['vgpu']"),
    (
        "sharing config GPU absent",
        [*PLUGIN, "--sharing-config={in}/gpu-9.yaml"],
        {},
        "--sharing-config names GPU index(es) [9], but this node's GPUs are [0, 1, 2, 3]",
    ),
    (
        "sharing config kind impossible",
        [*PLUGIN, "--sharing-config={in}/gpu-0-mig.yaml"],
        {},
        "--sharing-config asks GPU 0 (NVIDIA L4) for mig, which it cannot offer",
    ),
    (
        "sharing config a directory",
        [*PLUGIN, "--sharing-config={in}"],
        {},
        "sharing config: cannot read {in}: Is a directory",
    ),
    (
        "sharing config not YAML",
        [*PLUGIN, "--sharing-config={in}/not-yaml.yaml"],
        {},
        "not-yaml.yaml is not valid YAML",
    ),
    ("sharing config a string", [*PLUGIN, "--sharing-config={in}/string.yaml"], {}, "expected a mapping"),
    (
        "sharing config gpus not a list",
        [*PLUGIN, "--sharing-config={in}/gpus-not-list.yaml"],
        {},
        "gpus must be a list",
    ),
    (
        "sharing config offer not a list",
        [*PLUGIN, "--sharing-config={in}/offer-not-list.yaml"],
        {},
        "offer: expected a list of kinds such as [whole, mps], found 5",
    ),
    (
        "sharing config index not a number",
        [*PLUGIN, "--sharing-config={in}/index-bool.yaml"],
        {},
        "gpus[0] must be {{index: <int 0 or more>, offer: [...]}}",
    ),
    ("mock machine unknown", [*PLUGIN, "--nvml=mock:nope"], {}, "unknown mock machine 'nope'; bundled: "),
    (
        "mock machine not YAML",
        [*PLUGIN, "--nvml=mock:{in}/not-yaml.yaml"],
        {},
        "machine profile: {in}/not-yaml.yaml is not",
    ),
    ("discover offers nothing", [*DISCOVER, "--offer=mig"], {}, "GPU(s) 0, 1, 2, 3 would offer no device"),
    ("discover node name invalid", [*DISCOVER, "--node-name=-n"], {}, "--node-name '-n' is not a node name"),
    ("plan file missing", [*PLAN, "{in}/missing.yaml"], {}, "fgpu plan: cannot read {in}/missing.yaml: No such file"),
    ("plan file not YAML", [*PLAN, "{in}/not-yaml.yaml"], {}, "fgpu plan: {in}/not-yaml.yaml is not valid YAML"),
    ("plan file empty", [*PLAN, "{in}/empty.yaml"], {}, "fgpu plan: {in}/empty.yaml: no objects in it (empty)"),
    (  # a folder's .yaml, .yml and .json files, read in name order, up to the first that is not a manifest
        "plan folder holding a file that is not a manifest",
        [*PLAN, "{in}"],
        {},
        "fgpu plan: {in}/gpu-0-mig.yaml: document 1: object without metadata.name",
    ),
    (
        "plan pod naming a missing template",
        [*PLAN, "{in}/pod-no-template.yaml"],
        {},
        "pod default/p: claim gpu names ResourceClaimTemplate default/t, which is not in the input",
    ),
    (
        "plan pod claim without a claim or template",
        [*PLAN, "{in}/pod-claim-neither.yaml"],
        {},
        "pod default/p: resourceClaims[0] needs a name and one of resourceClaimName, resourceClaimTemplateName",
    ),
    (
        "plan deployment replicas not a number",
        [*PLAN, "{in}/deployment-replicas.yaml"],
        {},
        "deployment default/d: spec.replicas must be a whole number, not 'two'",
    ),
    ("plan nothing to read", ["plan"], {}, "fgpu: plan: give manifests (files, folders, - for stdin) or --kubeconfig"),
    ("plan kubeconfig missing", ["plan", "--kubeconfig={in}/missing"], {}, KUBECONFIG_ERROR + "missing: no such file"),
    (
        "plan object without metadata",
        [*PLAN, "{in}/no-metadata.yaml"],
        {},
        "fgpu plan: {in}/no-metadata.yaml: document 1: ResourceClaim without metadata.name",
    ),
    (
        "plan list of non-objects",
        [*PLAN, "{in}/list-of-numbers.yaml"],
        {},
        "document 1, items[0]: expected a Kubernetes object, found int",
    ),
    (
        "plan object malformed",
        [*PLAN, "{in}/class.yaml", "--classes={in}/no-metadata.yaml"],
        {},
        "without metadata.name",
    ),
    (
        "status kubeconfig not YAML",
        ["status", "--kubeconfig={in}/not-yaml.yaml"],
        {},
        "not-yaml.yaml is not valid YAML",
    ),
    ("status kubeconfig from env", ["status"], {"KUBECONFIG": "{in}/string.yaml"}, "string.yaml is not a kubeconfig"),
    (
        "health clear state dir absent",
        ["health", "clear", "--state-dir={out}/state"],
        {},
        "--state-dir '{out}/state' is not a directory; give the plugin's state directory",
    ),
    (
        "mock fault GPU not a number",
        ["mock", "fault", "--nvml=mock:l4x4", "--gpu=x", "ecc"],
        {},
        "fgpu mock fault: argument --gpu: invalid int value: 'x'",
    ),
    (
        "mock fault unknown fault",
        ["mock", "fault", "--nvml=mock:l4x4", "--gpu=0", "fire"],
        {},
        "invalid choice: 'fire'",
    ),
    (
        "mig share profile unknown",
        [*DISCOVER, "--offer=mig,mig-mps", "--mig-share-profiles=3g.40gb"],
        {},
        "fgpu: --mig-share-profiles / migShareProfiles name MIG profile(s) 3g.40gb that no GPU of this node has; "
        "its GPUs have no MIG",
    ),
    (
        "mig share profiles not a list",
        [*DISCOVER, "--sharing-config={in}/mig-profiles-number.yaml"],
        {},
        "migShareProfiles: expected a list of MIG profiles such as [3g.40gb], found 3",
    ),
    ("controller port too large", ["controller", "--metrics-port=99999"], {}, "--metrics-port: '99999' is not a port"),
    (
        "controller no evictions a minute",
        ["controller", "--make-room", "--evictions-per-minute=0"],
        {},
        "--evictions-per-minute: '0' is not a whole number above 0",
    ),
    (
        "controller compaction without making room",
        ["controller", "--compact-when-idle"],
        {},
        "--compact-when-idle moves pods as making room does: give --make-room too",
    ),
    ("controller env seconds garbage", ["controller"], {"LEASE_DURATION": "x"}, "LEASE_DURATION='x' is not a number"),
    (
        "controller lease timings",
        ["controller", "--leader-elect-retry-period=20"],
        {},
        "--leader-elect-*: lease timings",
    ),
    ("controller kubeconfig not YAML", ["controller", "--kubeconfig={in}/not-yaml.yaml"], {}, "is not valid YAML"),
    (
        "webhook certificate missing",
        [*WEBHOOK, "--tls-cert-file={in}/missing.crt"],
        {},
        "fgpu: --tls-cert-file/--tls-private-key-file: cannot load {in}/missing.crt: [Errno 2] No such file",
    ),
    (
        "webhook certificate not PEM",
        [*WEBHOOK, "--tls-cert-file={in}/file", "--tls-private-key-file={in}/file"],
        {},
        "cannot load {in}/file: [SSL]",
    ),
    ("webhook port zero", [*WEBHOOK, "--port=0"], {}, "fgpu: --port 0: the webhook needs a port (1-65535)"),
    (
        "webhook toleration not a taint key",
        [*WEBHOOK, "--gpu-pods-toleration=gpu pods"],
        {},
        "fgpu: --gpu-pods-toleration 'gpu pods': not a taint key",
    ),
    ("webhook env port garbage", WEBHOOK, {"WEBHOOK_PORT": "https"}, "--port: WEBHOOK_PORT='https' is not a port"),
    ("webhook without certificate", ["webhook"], {}, "the following arguments are required: --tls-cert-file"),
]


@pytest.fixture
def inputs() -> Iterator[Path]:
    # A short path of its own, not pytest's: the plugin's socket paths must stay within gRPC's 105
    # bytes wherever pytest puts its temporary directories (a worker's is longer).
    with tempfile.TemporaryDirectory(prefix="fgpu-bad-") as scratch:
        directory = Path(scratch) / "in"
        directory.mkdir()
        for name, text in INPUTS.items():
            (directory / name).write_text(text)
        (Path(scratch) / "out").mkdir()
        yield directory


def fgpu(args: list[str], env: dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
    # No KUBECONFIG, no in-cluster service account, no mock GPU state: only what the case gives.
    environment = {"PATH": os.environ["PATH"], **env}
    return subprocess.run([sys.executable, "-m", "driver.cli", *args], capture_output=True, text=True, env=environment,
                          timeout=timeout)  # fmt: skip


def snapshot(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.mark.parametrize(("args", "env", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_exit_2_and_changes_nothing(
    inputs: Path, args: list[str], env: dict[str, str], expected: str
):
    out = inputs.parent / "out"
    fill = {"in": str(inputs), "out": str(out)}
    before = snapshot(inputs)
    run = fgpu([a.format(**fill) for a in args], {k: v.format(**fill) for k, v in env.items()})
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 2, run.stderr
    assert len(lines) == 1 and lines[0].startswith("fgpu"), run.stderr
    assert expected.format(**fill) in lines[0]
    assert "Traceback" not in run.stderr and not run.stdout
    assert list(out.iterdir()) == []  # no state, CDI, plugin or registrar directory made
    assert snapshot(inputs) == before and sorted(p.name for p in inputs.parent.iterdir()) == ["in", "out"]


@pytest.mark.skipif(bool(shutil.which("nvidia-smi")), reason="this host has NVIDIA GPUs")
def test_real_nvml_without_a_gpu_is_one_line(inputs: Path):
    run = fgpu([*DISCOVER, "--nvml=real"], {})
    assert (run.returncode, run.stderr.strip()) == (2, "fgpu: NVML init failed: NVML Shared Library Not Found")


def test_a_bad_environment_variable_does_not_break_help():
    env = {"UNPREPARE_GRACE": "abc", "HEALTH_MONITOR": "yes", "LEASE_DURATION": "x", "HEALTHCHECK_PORT": "-9",
           "WEBHOOK_PORT": "x"}  # fmt: skip
    for args in (["--help"], ["kubelet-plugin", "--help"], ["controller", "--help"], ["webhook", "--help"]):
        run = fgpu(args, env)
        assert (run.returncode, run.stderr) == (0, ""), run.stderr
    run = fgpu(["discover", "--node-name=n1", "--nvml=mock:l4x4", "-o", "json"], env)  # not its flags: unaffected
    assert run.returncode == 0, run.stderr


def test_make_run_with_an_unknown_machine_stops_before_the_control_plane():
    started = time.monotonic()
    # Its own session: a control-plane process it started would stay in it, even after it exited.
    with subprocess.Popen([sys.executable, "-m", "examples.local_node", "--nvml", "mock:nope"], text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True) as run:  # fmt: skip
        stdout, stderr = run.communicate(timeout=60)
    assert run.returncode == 2
    assert stderr.strip().startswith("fgpu: unknown mock machine 'nope'; bundled: ")
    assert len(stderr.strip().splitlines()) == 1 and not stdout
    assert time.monotonic() - started < 20  # the control plane alone takes longer to start
    assert not session_processes(run.pid), "it started processes that outlived it"


def session_processes(session: int) -> list[str]:
    """The processes still in this session, as "pid (command)"."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            head, _, fields = stat.read_text().rpartition(")")
        except OSError:  # gone meanwhile
            continue
        if int(fields.split()[3]) == session:  # after "pid (comm)": state, ppid, pgrp, session
            found.append(head + ")")
    return found
