"""The node's GPU faults, kept in `<state-dir>/health.json`: they outlive a plugin restart (a
fault is not forgotten by restarting), two plugin instances during a rolling update see the same
ones, and `fgpu health clear` edits them while the plugin runs."""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Literal

from driver.common.files import atomic_write, locked

log = logging.getLogger(__name__)
FaultKind = Literal["xid", "ecc", "lost", "driver"]  # driver: not loaded, every GPU out of reach


@dataclass(frozen=True)
class MigSlices:
    """The memory slices of the MIG instance a fault came from (its GPU instance's placement)."""

    start: int
    size: int


@dataclass(frozen=True)
class GpuFault:
    """One fault condition on a GPU, or on one MIG instance's slices. Times are wall-clock seconds:
    they must mean the same to another instance and after a restart."""

    gpu_uuid: str
    kind: FaultKind
    xid: int | None = None
    mig: MigSlices | None = None
    first_seen: float = 0.0
    last_seen: float = 0.0  # a lost GPU is seen again at every probe while it stays lost

    @property
    def key(self) -> tuple[str, str, int | None, MigSlices | None]:
        return (self.gpu_uuid, self.kind, self.xid, self.mig)


class HealthRecord:
    def __init__(self, state_dir: Path) -> None:
        self.path = state_dir / "health.json"

    @contextlib.contextmanager
    def _locked(self, exclusive: bool) -> Iterator[None]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with locked(self.path.with_suffix(".lock"), exclusive=exclusive):
            yield

    def read(self) -> list[GpuFault]:
        with self._locked(exclusive=False):
            return self._load()

    def update(self, change: Callable[[list[GpuFault]], list[GpuFault]]) -> list[GpuFault]:
        with self._locked(exclusive=True):
            faults = change(self._load())
            data = json.dumps([asdict(f) for f in faults], sort_keys=True).encode()
            atomic_write(self.path, data, durable=False)
            return faults

    def record(self, *seen: GpuFault) -> list[GpuFault]:
        """Add faults, or refresh those seen before (their first sighting stays), in one write."""

        def add(faults: list[GpuFault]) -> list[GpuFault]:
            for fault in seen:
                known = next((i for i, f in enumerate(faults) if f.key == fault.key), None)
                if known is None:
                    faults.append(fault)
                else:
                    faults[known] = replace(faults[known], last_seen=fault.last_seen)
            return faults

        return self.update(add)

    def clear(self, gpu_uuids: set[str] | None = None) -> list[GpuFault]:
        """Forget the faults of these GPUs (all GPUs when None): an operator's word that they are fine."""
        return self.update(lambda faults: [f for f in faults if gpu_uuids is not None and f.gpu_uuid not in gpu_uuids])

    def _load(self) -> list[GpuFault]:
        try:
            raw = json.loads(self.path.read_text())
            return [
                GpuFault(**{**entry, "mig": MigSlices(**entry["mig"]) if entry.get("mig") else None}) for entry in raw
            ]
        except FileNotFoundError:
            return []
        except (ValueError, TypeError, KeyError) as err:
            log.warning("health record %s unreadable (%s); starting with no faults", self.path, err)
            return []
