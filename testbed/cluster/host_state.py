"""What a real node changes on the host, recorded before it starts and put back after it stops.

kubelet and containerd change things outside their directories: sysctls (kubelet sets
vm.overcommit_memory, kernel.panic, ...; the CNI bridge turns on IP forwarding), iptables chains
(KUBE-FIREWALL, KUBE-KUBELET-CANARY, KUBE-IPTABLES-HINT), hard-coded directories
(/var/lib/kubelet/device-plugins, /run/containerd, /var/lib/cni, /var/log/containers), `kubepods`
cgroups in every hierarchy, the bridge device. `HostState.take()` records them; `restore()` puts
back what changed; `differences()` lists what a test bed left behind (the clean-up test).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# Every sysctl kubelet (protectKernelDefaults: false) or the CNI bridge plugin may set.
SYSCTLS = (
    "vm.overcommit_memory",
    "vm.panic_on_oom",
    "kernel.panic",
    "kernel.panic_on_oops",
    "kernel.keys.root_maxkeys",
    "kernel.keys.root_maxbytes",
    "net.ipv4.ip_forward",
    "net.ipv6.conf.all.forwarding",
)
# Paths kubelet, containerd and the CNI plugins use whatever their root directories say.
HARD_CODED_PATHS = (
    Path("/var/lib/kubelet"),
    Path("/var/lib/cni"),
    Path("/var/log/containers"),
    Path("/var/log/pods"),
    Path("/run/containerd"),
    Path("/run/netns"),
    Path("/run/nri"),  # containerd's NRI socket
    Path("/etc/cni"),
)
IPTABLES = ("iptables", "ip6tables")
OUR_PROGRAMS = ("kubelet", "containerd", "containerd-shim", "etcd", "kube-apiserver", "kube-controller",
                "kube-scheduler", "pause", "nvidia-cuda-mps")  # fmt: skip
TEMP_PREFIX = "/tmp/fgpu-"
# Set by a test run for every process it starts (they inherit it): other runs on the same machine
# are not this run's leftovers.
RUN_MARKER = "FGPU_TEST_RUN"
CGROUP_ROOT = Path("/sys/fs/cgroup")
OUR_CGROUPS = ("kubepods", "kubepods.slice")


# One real node per host at a time: kubelet's cgroups, hard-coded directories, iptables chains and
# sysctls are the host's (two kubelets kill each other's pods as orphans), and a node's teardown
# puts them back. An flock on this directory (nothing is created in it) makes a second node, or a
# snapshot of the host, wait for the first node to stop instead of trampling it or seeing it.
HOST_LOCK = Path("/run/lock") if Path("/run/lock").is_dir() else Path("/tmp")
HOST_LOCK_TIMEOUT_S = 1800
# While a node runs: its directory, its run's temp prefix and the host before it, so that
# `python -m testbed.cluster.node cleanup` can put the host back after the run was killed.
NODE_RECORD = HOST_LOCK / "fgpu-real-node.json"


def lock_host() -> int:
    """Wait for the host (no other test node on it) and hold it; returns the descriptor to unlock."""
    descriptor = os.open(HOST_LOCK, os.O_RDONLY)
    deadline = time.monotonic() + HOST_LOCK_TIMEOUT_S
    waited = False
    while True:
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return descriptor
        except BlockingIOError:
            if time.monotonic() > deadline:
                os.close(descriptor)
                raise TimeoutError(f"another test node held this host for {HOST_LOCK_TIMEOUT_S}s") from None
            if not waited:
                log.warning("another test node runs on this host; waiting for it to stop")
                waited = True
            time.sleep(1)


def unlock_host(descriptor: int) -> None:
    os.close(descriptor)  # closing the descriptor releases the flock


def _sysctl_path(name: str) -> Path:
    return Path("/proc/sys") / name.replace(".", "/")


def read_sysctls() -> dict[str, str]:
    values = {}
    for name in SYSCTLS:
        with contextlib.suppress(OSError):
            values[name] = _sysctl_path(name).read_text().strip()
    return values


def iptables_save(tool: str) -> str | None:
    """The rules as `<tool>-save` prints them, or None where the tool is not installed."""
    if shutil.which(f"{tool}-save") is None:
        return None
    done = subprocess.run([f"{tool}-save"], capture_output=True, text=True, check=False)
    # Comments and counters change with every packet; only tables, chains and rules matter.
    return "\n".join(
        line.split(" [")[0] if line.startswith(":") else line
        for line in done.stdout.splitlines()
        if not line.startswith("#")
    )


def iptables_chains(saved: str | None) -> set[str]:
    """'table/chain' for every user-defined chain of a saved rule set (built-in chains have a
    policy instead of '-'; iptables-nft keeps a table's empty built-in chains once it exists)."""
    chains, table = set(), ""
    for line in (saved or "").splitlines():
        if line.startswith("*"):
            table = line[1:]
        elif line.startswith(":") and line.split()[1] == "-":
            chains.add(f"{table}/{line[1:].split()[0]}")
    return chains


def net_devices() -> set[str]:
    return set(os.listdir("/sys/class/net"))


def mount_points() -> set[str]:
    with open("/proc/self/mountinfo") as handle:
        return {line.split()[4] for line in handle}


def our_cgroups() -> set[str]:
    """kubepods cgroups in every hierarchy (cgroup v1 has one per controller)."""
    found = set()
    for name in OUR_CGROUPS:
        found.update(str(path) for path in CGROUP_ROOT.glob(f"*/{name}"))
        found.update(str(path) for path in CGROUP_ROOT.glob(name))
    return found


def our_processes() -> set[str]:
    """'pid name' of running test-bed programs (comm is cut at 15 characters), of this run only
    where RUN_MARKER is set."""
    marker = f"{RUN_MARKER}={os.environ[RUN_MARKER]}".encode() if RUN_MARKER in os.environ else None
    found = set()
    for proc in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            if not proc.name.isdigit() or not (comm := (proc / "comm").read_text().strip()).startswith(OUR_PROGRAMS):
                continue
            if marker is None or marker in (proc / "environ").read_bytes().split(b"\0"):
                found.add(f"{proc.name} {comm}")
    return found


def run_prefix() -> str:
    """The prefix of this run's temporary directories."""
    return TEMP_PREFIX + os.environ.get(RUN_MARKER, "")[:8]


def short_temp_dir(purpose: str = "") -> Path:
    """A directory under /tmp (Unix socket paths are limited to 108 bytes; pytest's tmp_path can be
    longer), named after this run so that its leftovers can be told from another run's."""
    return Path(tempfile.mkdtemp(prefix=f"{run_prefix()}-{purpose}", dir=Path(TEMP_PREFIX).parent))


def temp_dirs(prefix: str | None = None) -> set[str]:
    """The temporary directories of this run, or of the run with that prefix."""
    return {str(path) for path in Path(TEMP_PREFIX).parent.glob(Path(prefix or run_prefix()).name + "*")}


_NAME_SETS = ("devices", "mounts", "cgroups", "processes", "temp")  # HostState's sets of names, as JSON lists


@dataclass(frozen=True)
class HostState:
    sysctls: dict[str, str]
    iptables: dict[str, str | None]
    existing_paths: frozenset[Path]
    devices: frozenset[str]
    mounts: frozenset[str]
    cgroups: frozenset[str]
    processes: frozenset[str]
    temp: frozenset[str]

    @classmethod
    def take_quiet(cls) -> HostState:
        """The host's state with no test node running on it (waits for one to stop)."""
        descriptor = lock_host()
        try:
            return cls.take()
        finally:
            unlock_host(descriptor)

    @classmethod
    def take(cls) -> HostState:
        return cls(
            sysctls=read_sysctls(),
            iptables={tool: iptables_save(tool) for tool in IPTABLES},
            existing_paths=frozenset(path for path in HARD_CODED_PATHS if path.exists()),
            devices=frozenset(net_devices()),
            mounts=frozenset(mount_points()),
            cgroups=frozenset(our_cgroups()),
            processes=frozenset(our_processes()),
            temp=frozenset(temp_dirs()),
        )

    def to_json(self) -> dict[str, object]:
        return {
            "sysctls": self.sysctls,
            "iptables": self.iptables,
            "existing_paths": sorted(str(path) for path in self.existing_paths),
            **{name: sorted(getattr(self, name)) for name in _NAME_SETS},
        }

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> HostState:
        return cls(
            sysctls=raw["sysctls"],
            iptables=raw["iptables"],
            existing_paths=frozenset(Path(path) for path in raw["existing_paths"]),
            **{name: frozenset(raw[name]) for name in _NAME_SETS},
        )

    def restore(self) -> None:
        """Put back what a node changed. Mounts and processes are the node's own to undo first:
        a cgroup with a process in it, or a directory with a mount on it, cannot go."""
        for name, value in self.sysctls.items():
            if read_sysctls().get(name) != value:
                _sysctl_path(name).write_text(value)
        for tool, saved in self.iptables.items():
            _restore_iptables(tool, saved)
        for device in net_devices() - self.devices:
            subprocess.run(["ip", "link", "delete", device], capture_output=True, check=False)
        for cgroup in sorted(our_cgroups() - self.cgroups):
            remove_cgroup_tree(Path(cgroup))
        for path in HARD_CODED_PATHS:
            if path not in self.existing_paths:
                shutil.rmtree(path, ignore_errors=True)

    def differences(self, now: HostState) -> list[str]:
        """What `now` has that this state had not, one line each (empty: the host is as it was)."""
        found = [
            f"sysctl {k}={now.sysctls.get(k)} (was {v})" for k, v in self.sysctls.items() if now.sysctls.get(k) != v
        ]
        for tool in IPTABLES:
            added = iptables_chains(now.iptables.get(tool)) - iptables_chains(self.iptables.get(tool))
            found += [f"{tool} chain {chain}" for chain in sorted(added)]
        found += [f"path {path}" for path in sorted(now.existing_paths - self.existing_paths)]
        found += [f"network device {device}" for device in sorted(now.devices - self.devices)]
        found += [f"mount {mount}" for mount in sorted(now.mounts - self.mounts)]
        found += [f"cgroup {cgroup}" for cgroup in sorted(now.cgroups - self.cgroups)]
        found += [f"process {process}" for process in sorted(now.processes - self.processes)]
        found += [f"temporary directory {path}" for path in sorted(now.temp - self.temp)]
        return found


def _restore_iptables(tool: str, saved: str | None) -> None:
    if saved is None or iptables_save(tool) == saved:
        return
    current = iptables_save(tool) or ""
    tables_before = {line[1:] for line in saved.splitlines() if line.startswith("*")}
    for table in {line[1:] for line in current.splitlines() if line.startswith("*")} - tables_before:
        # A table the node brought: empty it (its built-in chains stay, as iptables-nft keeps them).
        subprocess.run([tool, "-t", table, "-F"], capture_output=True, check=False)
        subprocess.run([tool, "-t", table, "-X"], capture_output=True, check=False)
    subprocess.run([f"{tool}-restore"], input=saved + "\n", text=True, capture_output=True, check=True)


def remove_cgroup_tree(path: Path) -> None:
    """rmdir a cgroup and its children, deepest first (a cgroup directory goes with rmdir only)."""
    if not path.is_dir():
        return
    for child in sorted((p for p in path.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
        with contextlib.suppress(OSError):
            child.rmdir()
    with contextlib.suppress(OSError):
        path.rmdir()
