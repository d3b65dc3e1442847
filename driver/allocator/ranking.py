"""The nodes in the fragmentation policy's order for one request, kept from claim to claim (pure).

For each claim the policy orders every node by the rise in fragmentation its best placement there
causes, ties in binpack's order (cluster.py, `_by_fragmentation`). At thousands of nodes that loop
is most of what a claim costs, while between two claims of one request only the nodes whose
devices, room for pods or usage changed score or rank otherwise. A Ranking keeps one request's
order (the policy's `ask`: the request and its pods' needs) for one version of the learned mix, and
takes in only the nodes touched since it was last used; Rankings keeps those of the requests asked
more than once, and the log of touched nodes they read. The allocator touches a node wherever what
the policy keeps for it goes (its view dropped, its room counted again, its usage changed: a node
whose slices change is measured again, and so touched); a new version of the mix (a new mix, a
new census of GPUs, a level of other resources) starts every ranking afresh.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from driver.allocator.fragmentation import Unit

# binpack's order of a node: (sign x its usage where it has any, else 0; its name), as node_order
Position = tuple[float, str]
Scored = tuple[float, float, str]  # (rise in F, position)
Entry = Scored | Position  # a node's place in a ranking: scored, or by position alone
Preferred = tuple[Sequence[Unit], tuple[int, ...]]  # the node's units, and the positions the claim should take
MAX_RANKINGS = 32  # requests kept (least recently used go): a fleet asks few, a varied trace many
MAX_ASKS_SEEN = 4096  # requests remembered as asked once (forgotten all at once past it)
# Touched nodes a ranking takes in one by one; past this share of the nodes it is built afresh.
REBUILD_SHARE = 0.25


@dataclass
class Ranking:
    """One request's order: the nodes the policy scored by (rise in F, position), then the others
    by position; with the units each scored node's placement should take."""

    version: int  # of the learned mix it was scored for
    synced: int  # how far into the touch log it has taken in
    scored: list[Scored] = field(default_factory=list)
    unscored: list[Position] = field(default_factory=list)
    prefer: dict[str, Preferred] = field(default_factory=dict)
    _entries: dict[str, Entry] = field(default_factory=dict)

    def fill(self, entries: dict[str, Entry], prefer: dict[str, Preferred]) -> None:
        """Every node's entry at once (a new ranking)."""
        self._entries, self.prefer = entries, prefer
        self.scored = sorted(e for e in entries.values() if len(e) == 3)
        self.unscored = sorted(e for e in entries.values() if len(e) == 2)

    def place(self, node: str, entry: Entry | None, prefer: Preferred | None) -> None:
        """The node's entry now: gone (None), not scored (its position), or scored."""
        old = self._entries.pop(node, None)
        if old is not None:
            del self._list(old)[bisect.bisect_left(self._list(old), old)]
        self.prefer.pop(node, None)
        if entry is None:
            return
        self._entries[node] = entry
        bisect.insort(self._list(entry), entry)
        if prefer is not None:
            self.prefer[node] = prefer

    def _list(self, entry: Entry) -> list[Any]:
        return self.scored if len(entry) == 3 else self.unscored

    def order(self) -> RankedNodes:
        return RankedNodes(self.scored, self.unscored)


class RankedNodes:
    """A ranking's order as node names, read in place: a claim reads the first few of thousands.
    Valid until the ranking next changes (the claim's own placement)."""

    def __init__(self, scored: list[Scored], unscored: list[Position]) -> None:
        self._scored, self._unscored = scored, unscored

    def __len__(self) -> int:
        return len(self._scored) + len(self._unscored)

    def __iter__(self) -> Iterator[str]:
        yield from (name for _, _, name in self._scored)
        yield from (name for _, name in self._unscored)


class Rankings:
    """The rankings of requests asked more than once, and the log of nodes touched since."""

    def __init__(self) -> None:
        self._by_ask: OrderedDict[int, Ranking] = OrderedDict()
        self._asked: set[int] = set()
        self._log: list[str] = []

    def touch(self, node: str) -> None:
        """What the policy keeps for the node changed: each ranking takes it in when next used."""
        if self._by_ask:
            self._log.append(node)

    def asked_before(self, ask: int) -> bool:
        """Whether the request was asked before (and now it has been)."""
        if ask in self._asked:
            return True
        if len(self._asked) >= MAX_ASKS_SEEN:
            self._asked.clear()
        self._asked.add(ask)
        return False

    def ranking(self, ask: int, version: int, nodes: int) -> tuple[Ranking, set[str] | None]:
        """The request's ranking and the nodes touched since it was last used (taken in now), or a
        new empty one and None (every node to score) where there was none for this version. A
        ranking that lags by more than REBUILD_SHARE of the `nodes` goes: scoring every node again
        costs less than taking those in one by one."""
        lagging = REBUILD_SHARE * nodes
        for behind in [a for a, r in self._by_ask.items() if len(self._log) - r.synced > lagging]:
            del self._by_ask[behind]
        self._trim()
        found = self._by_ask.get(ask)
        if found is not None and found.version == version:
            self._by_ask.move_to_end(ask)
            touched = set(self._log[found.synced :])
            found.synced = len(self._log)
            return found, touched
        made = self._by_ask[ask] = Ranking(version, len(self._log))
        self._by_ask.move_to_end(ask)
        if len(self._by_ask) > MAX_RANKINGS:
            self._by_ask.popitem(last=False)
        return made, None

    def _trim(self) -> None:
        """The log's prefix every ranking has taken in goes (all of it where there is none)."""
        done = min((r.synced for r in self._by_ask.values()), default=len(self._log))
        if done > 1024 or not self._by_ask:
            del self._log[:done]
            for ranking in self._by_ask.values():
                ranking.synced -= done
