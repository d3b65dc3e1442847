"""The kinds of device a GPU can offer (DeviceKind: whole, MIG, MPS, time-slicing, and shares
inside a MIG partition) and the node's configuration of which kinds each GPU offers (--offer,
--sharing-config, --mig-share-profiles). What a GPU then offers, and why not: driver/inventory/offers.py."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, get_args

from driver.common.yamlfile import YamlFileError, load_yaml

# What a published device stands for; mig-mps, mig-timeslice: MPS or time-sliced shares inside a
# MIG partition (docs/sharing.md).
DeviceKind = Literal["whole", "mig", "mps", "timeslice", "mig-mps", "mig-timeslice"]
ALL_KINDS: frozenset[DeviceKind] = frozenset(get_args(DeviceKind))
MIG_KINDS: frozenset[DeviceKind] = frozenset({"mig", "mig-mps", "mig-timeslice"})  # need MIG mode on
DEFAULT_KINDS: frozenset[DeviceKind] = frozenset({"whole", "mig", "mps", "timeslice"})


class SharingConfigError(ValueError):
    pass


@dataclass(frozen=True)
class SharingConfig:
    default: frozenset[DeviceKind] = DEFAULT_KINDS
    per_gpu: dict[int, frozenset[DeviceKind]] = field(default_factory=dict)
    # Counter sets that keep one GPU's devices apart (the cluster's DRAPartitionableDevices).
    shared_counters: bool = True
    # The MIG profiles whose partitions offer shares (mig-mps, mig-timeslice); None: every profile.
    # Each placement of each profile is a device per kind, so a short list keeps the slices small.
    mig_share_profiles: frozenset[str] | None = None
    per_gpu_mig_share_profiles: dict[int, frozenset[str]] = field(default_factory=dict)

    def offered(self, gpu_index: int) -> frozenset[DeviceKind]:
        return self.per_gpu.get(gpu_index, self.default)

    def shares_mig_profile(self, gpu_index: int, profile: str) -> bool:
        profiles = self.per_gpu_mig_share_profiles.get(gpu_index, self.mig_share_profiles)
        return profiles is None or profile in profiles


def parse_kinds(value: object, where: str) -> frozenset[DeviceKind]:
    """A comma list (`--offer`) or a YAML list of kinds."""
    if isinstance(value, str):
        items = [v.strip() for v in value.split(",")]
    elif isinstance(value, list) and all(isinstance(v, str) for v in value):
        items = value
    else:
        raise SharingConfigError(f"{where}: expected a list of kinds such as [whole, mps], found {value!r}")
    unknown = sorted(set(items) - ALL_KINDS)
    if unknown:
        raise SharingConfigError(f"{where}: unknown kind(s) {unknown}; valid: {sorted(ALL_KINDS)}")
    return frozenset(items)  # type: ignore[arg-type]


def parse_profiles(value: object, where: str) -> frozenset[str] | None:
    """A comma list (`--mig-share-profiles`) or a YAML list of MIG profile names; empty: every profile."""
    if isinstance(value, str):
        items = [v.strip() for v in value.split(",") if v.strip()]
    elif isinstance(value, list) and all(isinstance(v, str) and v for v in value):
        items = value
    else:
        raise SharingConfigError(f"{where}: expected a list of MIG profiles such as [3g.40gb], found {value!r}")
    return frozenset(items) or None


def load_sharing_config(offer: str, path: Path | None, mig_share_profiles: str = "") -> SharingConfig:
    """`--offer whole,mig,mps,timeslice` for every GPU; a YAML file may override per GPU:
    `gpus: [{index: 0, offer: [mig]}, {index: 1, offer: [mps, mig-mps], migShareProfiles: [3g.40gb]}]`."""
    default = parse_kinds(offer, "--offer")
    profiles = parse_profiles(mig_share_profiles, "--mig-share-profiles")
    if path is None:
        return SharingConfig(default=default, mig_share_profiles=profiles)
    try:
        raw = load_yaml(path) or {}
    except YamlFileError as err:
        raise SharingConfigError(f"sharing config: {err}") from err
    if not isinstance(raw, dict):
        raise SharingConfigError(
            f"{path}: expected a mapping {{offer: [...], gpus: [...]}}, found {type(raw).__name__}"
        )
    unknown = set(raw) - {"offer", "gpus", "migShareProfiles"}
    if unknown:
        raise SharingConfigError(f"{path}: unknown field(s) {sorted(unknown)}")
    if "offer" in raw:
        default = parse_kinds(raw["offer"], f"{path}: offer")
    if "migShareProfiles" in raw:
        profiles = parse_profiles(raw["migShareProfiles"], f"{path}: migShareProfiles")
    gpus = raw.get("gpus") or []
    if not isinstance(gpus, list):
        raise SharingConfigError(f"{path}: gpus must be a list of {{index: <int>, offer: [...]}}")
    per_gpu = {}
    per_gpu_profiles = {}
    for i, entry in enumerate(gpus):
        if (
            not isinstance(entry, dict)
            or not {"index", "offer"} <= set(entry) <= {"index", "offer", "migShareProfiles"}
            or not _is_index(entry["index"])
        ):
            raise SharingConfigError(
                f"{path}: gpus[{i}] must be {{index: <int 0 or more>, offer: [...]}}, migShareProfiles optional"
            )
        if entry["index"] in per_gpu:
            raise SharingConfigError(f"{path}: gpus[{i}]: GPU {entry['index']} has an entry already")
        per_gpu[entry["index"]] = parse_kinds(entry["offer"], f"{path}: gpus[{i}].offer")
        if "migShareProfiles" in entry:
            found = parse_profiles(entry["migShareProfiles"], f"{path}: gpus[{i}].migShareProfiles")
            if found is not None:
                per_gpu_profiles[entry["index"]] = found
    return SharingConfig(default, per_gpu, mig_share_profiles=profiles, per_gpu_mig_share_profiles=per_gpu_profiles)


def _is_index(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0  # YAML's true is an int
