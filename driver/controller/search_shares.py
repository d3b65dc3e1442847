"""Each namespace's share of a pass's search (docs/allocator.md, "Search budget").

Tenants are namespaces, and one tenant's claims must not take a pass from the others'. Every unit
(a claim, or a gang) searches within its own budget (driver/allocator/allocate.py, SearchBudget);
what a namespace's units spend in a pass counts against its share, SHARE_UNITS budgets' worth.
Once that is spent, its remaining units wait for the next pass (controller.py runs one at least
every 5 s) and the other namespaces' units go on. Ordinary claims spend a few thousand steps at
most, so only a namespace whose claims search for long ever meets its share."""

from __future__ import annotations

from dataclasses import dataclass, field

from driver.allocator.allocate import SEARCH_STEPS, SearchBudget

SHARE_UNITS = 2  # a namespace's share of one pass: this many units' budgets


@dataclass
class _Share:
    spent: int = 0  # by the namespace's units before the last
    last: SearchBudget | None = None  # the last unit's, still being spent


@dataclass
class SearchShares:
    steps: int = SEARCH_STEPS  # one unit's budget
    _shares: dict[str, _Share] = field(default_factory=dict)

    def budget(self, namespace: str) -> SearchBudget | None:
        """A budget for the namespace's next unit, or None when it has spent its share of this
        pass. Units are searched one at a time: the last one's spending is final by the next."""
        share = self._shares.setdefault(namespace, _Share())
        if share.last is not None:
            share.spent, share.last = share.spent + share.last.spent, None
        if share.spent >= self.steps * SHARE_UNITS:
            return None
        share.last = SearchBudget(self.steps)
        return share.last


def share_spent(namespace: str) -> str:
    """What a unit whose namespace has spent its share says while it waits."""
    return (
        f"waits for the next pass: the claims of namespace {namespace} have searched for devices as long as "
        "one pass allows a namespace"
    )
