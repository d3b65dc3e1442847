"""Prepared claims: the domain objects, and their store on top of the checkpoint file."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

from driver.checkpoint import Checkpoint, CheckpointData


@dataclass(frozen=True)
class PreparedDevice:
    request_names: tuple[str, ...]
    pool: str
    device: str
    cdi_ids: tuple[str, ...]
    share_id: str | None = None


@dataclass(frozen=True)
class PreparedClaim:
    uid: str
    namespace: str
    name: str
    devices: tuple[PreparedDevice, ...]
    # What the CDI spec needs to be rewritten without the API server (after a reboot, or when
    # the file went missing): device name -> its CDI device nodes.
    device_nodes: dict[str, tuple[str, ...]]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> PreparedClaim:
        return cls(
            uid=raw["uid"],
            namespace=raw["namespace"],
            name=raw["name"],
            devices=tuple(
                PreparedDevice(
                    request_names=tuple(d["request_names"]),
                    pool=d["pool"],
                    device=d["device"],
                    cdi_ids=tuple(d["cdi_ids"]),
                    share_id=d.get("share_id"),
                )
                for d in raw["devices"]
            ),
            device_nodes={name: tuple(nodes) for name, nodes in raw["device_nodes"].items()},
        )


class PreparedClaims:
    """The claims this node has prepared, as the checkpoint records them."""

    def __init__(self, checkpoint: Checkpoint) -> None:
        self._checkpoint = checkpoint

    def all(self) -> dict[str, PreparedClaim]:
        return {uid: PreparedClaim.from_json(raw) for uid, raw in self._checkpoint.read().claims.items()}

    def get(self, uid: str) -> PreparedClaim | None:
        raw = self._checkpoint.read().claims.get(uid)
        return PreparedClaim.from_json(raw) if raw else None

    def commit(self, prepared: Iterable[PreparedClaim] = (), removed: Iterable[str] = ()) -> None:
        """Record newly prepared claims and forget unprepared ones in one durable write."""
        records = {claim.uid: claim.to_json() for claim in prepared}
        gone = list(removed)

        def change(data: CheckpointData) -> None:
            data.claims.update(records)
            for uid in gone:
                data.claims.pop(uid, None)

        self._checkpoint.apply(change)
