"""The order claims are placed in, as units: lone claims first, in the order given (the controller
gives creation order), then our labelled gangs (opt_in.py), then upstream PodGroup gangs
(driver/controller/groups.py), each gang all or none; and what a gang that cannot be placed yet
says. Shared by the controller (driver/controller/placing.py) and `fgpu plan` (driver/cli/plan.py),
so that the plan places as the controller does, with the same words."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

from driver.allocator.model import Claim
from driver.scheduling.opt_in import GANG_SIZE_LABEL, OPT_IN_LABEL, OPT_IN_VALUE, gang_of

T = TypeVar("T")


@dataclass(frozen=True)
class Lone(Generic[T]):
    """A claim placed on its own."""

    member: T


@dataclass(frozen=True)
class Gang(Generic[T]):
    """The waiting claims of a labelled gang (namespace/name, and its size: 0 when the label is
    not a whole number)."""

    name: str
    size: int
    members: list[T]


@dataclass(frozen=True)
class Group(Generic[T]):
    """The waiting claims of a PodGroup with a gang policy, or of a workload operator's gang
    (driver/scheduling/framework_gangs.py) (namespace/name)."""

    name: str
    members: list[T]


def claim_opted_in(claim: Claim) -> bool:
    return claim.labels.get(OPT_IN_LABEL) == OPT_IN_VALUE


def units(
    items: Iterable[T], claim_of: Callable[[T], Claim], group_of: Callable[[T], str | None]
) -> Iterator[Lone[T] | Gang[T] | Group[T]]:
    """The items as units: each lone one as it comes (it is placed before the next is looked at),
    then the gangs, then the groups. A gang label counts only on an opt-in claim, and comes before
    the claim's PodGroup; `group_of` says the PodGroup gang an item is in (None: none)."""
    gangs: dict[tuple[str, int], list[T]] = defaultdict(list)
    groups: dict[str, list[T]] = defaultdict(list)
    for item in items:
        claim = claim_of(item)
        gang = gang_of(claim) if claim_opted_in(claim) else None
        if gang is not None:
            gangs[gang].append(item)
        elif (group := group_of(item)) is not None:
            groups[group].append(item)
        else:
            yield Lone(item)
    for (name, size), members in gangs.items():
        yield Gang(name, size, members)
    for name, grouped in groups.items():
        yield Group(name, grouped)


def size_unreadable(gang: Gang[T]) -> str | None:
    """Why the gang is never placed as it is labelled, if it is not."""
    return f"label {GANG_SIZE_LABEL} must be a whole number" if gang.size == 0 else None


def gang_incomplete(gang: Gang[T], allocated: int) -> str | None:
    """Why the gang waits (fewer claims than its size, with `allocated` members placed before),
    if it does."""
    missing = gang.size - len(gang.members) - allocated
    return f"gang {gang.name} waits for {missing} more claim(s) of {gang.size}" if missing > 0 else None


def group_absent(group: str, why: str | None) -> str:
    """A PodGroup gang's claims wait: the PodGroup is not there (or cannot be read: `why`)."""
    return f"pod group {group} waits: no PodGroup {group} (scheduling.k8s.io/v1beta1) to read" + (
        f": {why}" if why else ""
    )


def group_size_unreadable(group: str) -> str:
    """An operator's gang (framework_gangs.py) whose pods say no whole number for its size."""
    return f"pod group {group} waits: its pods' gang size is not a whole number (framework_gangs.py)"


def group_incomplete(group: str, present: int, size: int) -> str:
    return f"pod group {group} waits for {size - present} more pod(s) of {size}"


def group_unplaced(group: str, size: int, reason: str) -> str:
    return f"pod group {group} (gang of {size} pods): {reason}"
