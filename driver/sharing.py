"""Node configuration: which kinds of device each GPU offers (whole, MIG, MPS, time-slicing)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, get_args

import yaml

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


def parse_kinds(value: str | list[str], where: str) -> frozenset[SharingKind]:
    items = [v.strip() for v in value.split(",")] if isinstance(value, str) else [str(v) for v in value]
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
        raw = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as err:
        raise SharingConfigError(f"cannot read sharing config {path}: {err}") from err
    unknown = set(raw) - {"offer", "gpus"}
    if unknown:
        raise SharingConfigError(f"{path}: unknown field(s) {sorted(unknown)}")
    if "offer" in raw:
        default = parse_kinds(raw["offer"], f"{path}: offer")
    per_gpu = {}
    for i, entry in enumerate(raw.get("gpus") or []):
        if not isinstance(entry, dict) or set(entry) != {"index", "offer"} or not isinstance(entry["index"], int):
            raise SharingConfigError(f"{path}: gpus[{i}] must be {{index: <int>, offer: [...]}}")
        per_gpu[entry["index"]] = parse_kinds(entry["offer"], f"{path}: gpus[{i}].offer")
    return SharingConfig(default=default, per_gpu=per_gpu)
