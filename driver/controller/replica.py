"""What one replica's collaborators share (kube-scheduler's framework handle): its API, its caches,
its ledgers, the pool its writes go out from, the flag a failed write raises, and whether it may
act; and the reads of the caches that more than one of them makes."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from collections.abc import Set as AbstractSet
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from driver.controller.api import ControllerApi
from driver.controller.fit import RoomReader
from driver.controller.groups import Groups
from driver.controller.ledger import Ledgers
from driver.controller.progress import Progress
from driver.kube.informer import Informer, object_key
from driver.scheduling.nodefit import NodeRoom
from driver.scheduling.opt_in import gated, held_by_another_gate, known_claim_names, owner_pod, pending


@dataclass(frozen=True)
class Replica:
    api: ControllerApi
    informers: dict[str, Informer]
    ledgers: Ledgers
    stale: threading.Event  # a write failed: end the pass, read afresh, then go on
    writers: ThreadPoolExecutor
    acting: Callable[[], bool]  # checked before every write: this replica leads and is not stopping
    progress: Progress  # beaten by the loop and after each unit a pass handles (the liveness probe)
    rooms: RoomReader  # the pods and nodes read for the last pass's room, kept until they change

    def stopped(self) -> bool:
        """Whether a pass stops here: a write failed, or this replica no longer acts."""
        return self.stale.is_set() or not self.acting()

    def waiting(self) -> list[dict[str, Any]]:
        """The opt-in claims waiting for an allocation, oldest first; not those a pod uses while
        another scheduling gate holds it (held_by_another_gate): they wait for that gate to go;
        nor a template's claim whose pod is not there (gone, going, or not yet seen)."""
        held_pods = [p for p in self.informers["pods"].items() if held_by_another_gate(p)]
        held_claims = {f"{p['metadata']['namespace']}/{name}" for p in held_pods for name in known_claim_names(p)}
        held_owners = {p["metadata"].get("uid") for p in held_pods}
        return sorted(
            (
                c
                for c in self.informers["claims"].items()
                if pending(c)
                and object_key(c) not in held_claims
                and not _owned_by(c, held_owners)
                and not self._orphaned(c)
            ),
            key=lambda c: (c["metadata"].get("creationTimestamp", ""), c["metadata"]["name"]),
        )

    def _orphaned(self, claim: dict[str, Any]) -> bool:
        """A template's claim whose pod is gone (a new pod of its name is another) or being
        deleted: kube-controller-manager took its allocation back when the pod went and deletes it
        next, so placing it again would hold devices, and write, for nothing (and fail once it is
        gone, ending the pass). Its pod not seen yet (the pods' watch behind the claims'): it waits
        for the pass the pod brings."""
        owner = owner_pod(claim)
        if owner is None:
            return False
        pod = self.informers["pods"].get(owner.key)
        return pod is None or pod["metadata"].get("uid") != owner.uid or bool(pod["metadata"].get("deletionTimestamp"))

    def any_gated(self) -> bool:
        """A pod waits at our gate (its claim perhaps not made yet): the controller is not idle."""
        return any(gated(pod) for pod in self.informers["pods"].items())

    def groups(self) -> Groups:
        """The PodGroups with a gang policy, their pods and claims, as the caches have them now."""
        claims = self.informers["claims"]
        return Groups(self.informers["podgroups"].items(), self.informers["pods"].items(), claims.get)

    def room(self, refused: Mapping[str, AbstractSet[str]]) -> NodeRoom:
        """What the nodes have left for the pods of the claims a pass places (fit.py); `refused`:
        pod key -> nodes kube-scheduler refused for it (refusals.py)."""
        return self.rooms.room(
            self.informers["nodes"].items(),
            self.informers["pods"].items(),
            self.informers["claims"].items(),
            refused,
        )


def _owned_by(claim: dict[str, Any], uids: AbstractSet[str | None]) -> bool:
    """Whether one of these pods owns the claim (a claim made from the pod's template)."""
    return any(ref.get("uid") in uids for ref in claim["metadata"].get("ownerReferences") or ())
