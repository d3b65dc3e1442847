"""Node configuration: which kinds of device each GPU offers (whole, MIG, MPS, time-slicing)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, get_args

from driver.yamlfile import YamlFileError, load_yaml

SharingKind = Literal["whole", "mig", "mps", "timeslice"]
ALL_KINDS: frozenset[SharingKind] = frozenset(get_args(SharingKind))


class SharingConfigError(ValueError):
    pass


@dataclass(frozen=True)
class SharingConfig:
    default: frozenset[SharingKind] = ALL_KINDS
    per_gpu: dict[int, frozenset[SharingKind]] = field(default_factory=dict)
    # Counter sets that keep one GPU's devices apart (the cluster's DRAPartitionableDevices).
    shared_counters: bool = True

    def offered(self, gpu_index: int) -> frozenset[SharingKind]:
        return self.per_gpu.get(gpu_index, self.default)


def parse_kinds(value: object, where: str) -> frozenset[SharingKind]:
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


def load_sharing_config(offer: str, path: Path | None) -> SharingConfig:
    """`--offer whole,mig,mps,timeslice` for every GPU; a YAML file may override per GPU:
    `gpus: [{index: 0, offer: [mig]}, {index: 1, offer: [mps, timeslice]}]`."""
    default = parse_kinds(offer, "--offer")
    if path is None:
        return SharingConfig(default=default)
    try:
        raw = load_yaml(path) or {}
    except YamlFileError as err:
        raise SharingConfigError(f"sharing config: {err}") from err
    if not isinstance(raw, dict):
        raise SharingConfigError(
            f"{path}: expected a mapping {{offer: [...], gpus: [...]}}, found {type(raw).__name__}"
        )
    unknown = set(raw) - {"offer", "gpus"}
    if unknown:
        raise SharingConfigError(f"{path}: unknown field(s) {sorted(unknown)}")
    if "offer" in raw:
        default = parse_kinds(raw["offer"], f"{path}: offer")
    gpus = raw.get("gpus") or []
    if not isinstance(gpus, list):
        raise SharingConfigError(f"{path}: gpus must be a list of {{index: <int>, offer: [...]}}")
    per_gpu = {}
    for i, entry in enumerate(gpus):
        if not isinstance(entry, dict) or set(entry) != {"index", "offer"} or not _is_index(entry["index"]):
            raise SharingConfigError(f"{path}: gpus[{i}] must be {{index: <int 0 or more>, offer: [...]}}")
        if entry["index"] in per_gpu:
            raise SharingConfigError(f"{path}: gpus[{i}]: GPU {entry['index']} has an entry already")
        per_gpu[entry["index"]] = parse_kinds(entry["offer"], f"{path}: gpus[{i}].offer")
    return SharingConfig(default=default, per_gpu=per_gpu)


def _is_index(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0  # YAML's true is an int
