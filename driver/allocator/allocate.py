"""Allocation on one node: the upstream allocator's depth-first search over claims, requests,
subrequests and devices, with the same checks in the same order, so it finds a solution exactly
when upstream does. What differs is the order devices are tried in: a `DeviceOrder` (scoring.py)
puts the best placements first, where upstream takes pool and slice order (first fit).

Two things bound the search where upstream has its DRA filter's timeout: a request with fewer
candidates than it asks for ends it before it starts (when upstream could meet no error on the
way), and a `SearchBudget` of steps (devices tried) ends it with SearchBudgetExceeded. Steps, not
seconds: the cut falls at the same place on every run and machine (tests, the differential test)."""

from __future__ import annotations

import functools
import uuid
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

from driver.allocator.capacity import consumption, fits
from driver.allocator.cel import CompiledSelector, SelectorError, compile_selector
from driver.allocator.model import MAX_RESULTS_PER_CLAIM, Claim, Constraint, Device, DeviceClass, DeviceId, Request
from driver.allocator.pools import Node, Pool, placement_matches
from driver.allocator.state import AllocatedState
from driver.claims.tenancy import Tenant, may_meet
from driver.common.quantity import Amount, format_amount

DeviceOrder = Callable[["NodeAllocator", list[Device]], list[Device]]
# Devices one claim's search (a gang's: all its members) may try, over every node it is tried on.
# Ordinary claims try tens to a few thousand (a claim no node of a full 50-node cluster takes: 2,800;
# the differential test's scenarios: at most 1,050). A claim of n shared requests and one that cannot
# be met tries 8^n on a DGX H100. A step costs 1-20 us (dearest: whole GPUs drawing shared counters),
# so this cuts such a claim in seconds: 2.0-3.7 s on a shared 2-core machine (`bench.allocator hostile`).
SEARCH_STEPS = 100_000
_UNBOUNDED = 1 << 62


SelectorResults = dict[Hashable, "bool | str"]  # selector_key -> matches, or the runtime error
# (also ("pool", outcomes) -> one tuple for equal outcomes of a pool's devices: _pool_outcomes)


def selector_key(selector: CompiledSelector, device: Device) -> Hashable:
    """What a selector's result on a device depends on: the values it reads, or all of the device
    where it cannot tell. Devices with the same key share one evaluation (a class selector on a
    million devices is evaluated a few times)."""
    if selector.reads is None:
        return selector.expression, device.id[0], device.shape, device.own
    return selector.expression, device.id[0], *(device.read(what) for what in selector.reads)


class AllocationError(Exception):
    """The claim cannot be allocated for a reason no other node changes (as upstream's errors):
    a missing class, a selector that does not compile or fails, a pool being updated."""


class SearchOrderError(AllocationError):
    """An error upstream's search meets only on reaching a certain device: a selector failing at
    runtime on a device an exact count tries, a constraint refusing a device an `All` request must
    take. Whether a claim ends with it depends on the order devices are tried in (docs/allocator.md)."""


class SearchBudgetExceeded(AllocationError):
    """The search tried more devices than its budget allows. It is incomplete: it says nothing of
    whether the claim fits (never remembered as not fitting)."""


@dataclass
class SearchBudget:
    """Steps (devices tried) a search may take, spent across every node it is tried on."""

    steps: int
    spent: int = 0
    exhausted: bool = False  # a search ran out: the claim's outcome is not known

    def reason(self, claims: Sequence[Claim]) -> str:
        keys = ", ".join(claim.key for claim in claims)
        return (
            f"claim {keys}: no answer within the search budget ({self.steps} devices tried): its requests "
            "together allow too many combinations; use fewer requests, or narrower selectors"
        )


@dataclass
class Chosen:
    request: Request
    device: Device
    share_id: str | None = None
    consumed: dict[str, Amount] | None = None


@dataclass
class _Candidates:
    request: Request
    devices: list[Device]
    errors: dict[int, str] = field(default_factory=dict)  # id(device) -> selector error, raised if reached


def compiled_selectors(
    classes: dict[str, DeviceClass], request: Request, claim: Claim
) -> list[tuple[str, CompiledSelector]]:
    """The class's selectors, then the request's, each named for error messages."""
    cls = classes.get(request.class_name)
    if cls is None:
        raise AllocationError(
            f"claim {claim.key}, request {request.full_name}: could not retrieve device class {request.class_name}"
        )
    compiled = []
    for owner, expressions in ((f"class {cls.name}", cls.selectors), (f"claim {claim.key}", request.selectors)):
        for index, expression in enumerate(expressions):
            try:
                compiled.append((f"{owner}: selector #{index}", compile_selector(expression)))
            except SelectorError as error:
                raise AllocationError(f"{owner}: selector #{index}: CEL compile error: {error}") from None
    return compiled


def _least(request: Request) -> int:
    """The fewest candidates a request can be met with: its count, or one device for `All`."""
    return request.count if request.mode == "ExactCount" else 1


def _selected(device: Device, outcomes: list[tuple[str, bool | str]]) -> bool:
    """All selectors true, in order; the first that failed on the device raises its error."""
    for where, outcome in outcomes:
        if outcome is False:
            return False
        if outcome is not True:
            raise AllocationError(f"{where} on device {'/'.join(device.id)}: {outcome}")
    return True


class NodeAllocator:
    def __init__(
        self,
        node: Node,
        pools: list[Pool],
        state: AllocatedState,
        classes: dict[str, DeviceClass],
        order: DeviceOrder | None = None,
        cache: dict[Any, Any] | None = None,
        selector_results: SelectorResults | None = None,
    ) -> None:
        """`cache` keeps what only the node's allocations change (the counters they leave, the
        ordered candidates of a request) between allocators of one node; the caller drops it when
        those allocations change. `selector_results` never goes stale (see selector_key): share
        one across nodes."""
        self.node, self.pools, self.state, self.classes, self.order = node, pools, state, classes, order
        self.selector_results: SelectorResults = {} if selector_results is None else selector_results
        self._cache = cache
        self._pool_of: dict[tuple[str, str], Pool] = {p.id: p for p in pools}
        # Per pool, what allocated devices leave of its counters (before this attempt).
        self._available: dict[tuple[str, str], dict[str, dict[str, Amount]]] = (
            {} if cache is None else cache.setdefault("available counters", {})
        )
        self._drawn: dict[tuple[str, str], dict[str, dict[str, Amount]]] = {}
        self._exclusive: dict[DeviceId, int] = {}  # devices taken in this attempt
        self._sharing: dict[DeviceId, list[dict[str, Amount]]] = {}  # shares taken in this attempt
        self._constraint_state: list[list[Any]] = []

    # --- request data (upstream: validateDeviceRequest) -------------------------------------------

    def _outcome(self, selector: CompiledSelector, device: Device) -> bool | str:
        key = selector_key(selector, device)
        outcome = self.selector_results.get(key)
        if outcome is None:
            try:
                outcome = selector.matches(device.cel_input())
            except SelectorError as error:
                outcome = str(error)
            self.selector_results[key] = outcome
        return outcome

    def _pool_outcomes(self, pool: Pool, selector: CompiledSelector) -> tuple[bool | str, ...]:
        """The selector on each of the pool's devices, kept with the pool (gathered anew when its
        slices change). Nodes of one kind have equal tuples: one object serves them all."""
        outcomes = pool.selector_outcomes.get(selector.expression)
        if outcomes is None:
            outcomes = tuple(self._outcome(selector, device) for device in pool.devices)
            interned: dict[Hashable, Any] = self.selector_results  # ("pool", outcomes) -> that tuple
            outcomes = interned.setdefault(("pool", outcomes), outcomes)
            pool.selector_outcomes[selector.expression] = outcomes
        return outcomes

    def _placed_here(self, device: Device) -> bool:
        return not device.per_device_placement or placement_matches(device.placement, self.node)

    def selectable(self, device: Device, selectors: list[tuple[str, CompiledSelector]]) -> bool:
        outcomes = [(where, self._outcome(selector, device)) for where, selector in selectors]
        return _selected(device, outcomes) and self._placed_here(device)

    def _candidates(self, request: Request, claim: Claim) -> _Candidates:
        if self._cache is None or request.mode != "ExactCount":
            return self._find_candidates(request, claim)
        key = (
            request.class_name,
            request.selectors,
            request.admin_access,
            tuple(sorted((request.capacity or {}).items())),
        )
        cached = self._cache.get(key)
        if cached is None:
            cached = self._cache[key] = self._find_candidates(request, claim)
        return _Candidates(request, cached.devices, cached.errors)

    def _find_candidates(self, request: Request, claim: Claim) -> _Candidates:
        selectors = compiled_selectors(self.classes, request, claim)
        candidates = _Candidates(request, [])
        if request.mode == "All":
            for pool in self.pools:
                if pool.incomplete:
                    raise AllocationError(
                        f"claim {claim.key}, request {request.full_name}: asks for all devices, "
                        f"but resource pool {pool.driver}/{pool.name} is currently being updated"
                    )
                if pool.invalid:
                    raise AllocationError(
                        f"claim {claim.key}, request {request.full_name}: asks for all devices, "
                        f"but resource pool {pool.driver}/{pool.name} is currently invalid"
                    )
                for device in pool.devices:
                    if not self.selectable(device, selectors):
                        continue
                    consumed = consumption(request.capacity, device.capacity)
                    if consumed is not None and fits(consumed, device.capacity):
                        candidates.devices.append(device)
            return candidates
        if request.mode != "ExactCount":
            raise AllocationError(
                f"claim {claim.key}, request {request.full_name}: unsupported count mode {request.mode}"
            )
        for pool in self.pools:
            columns = [(where, self._pool_outcomes(pool, selector)) for where, selector in selectors]
            for index, device in enumerate(pool.devices):
                try:
                    outcomes = [(where, column[index]) for where, column in columns]
                    if _selected(device, outcomes) and self._placed_here(device):
                        candidates.devices.append(device)
                except AllocationError as error:
                    candidates.devices.append(device)  # fails the claim only if the search reaches it
                    candidates.errors[id(device)] = str(error)
        if self.order is not None:
            candidates.devices = self.order(self, candidates.devices)
        return candidates

    # --- state of this attempt --------------------------------------------------------------------

    def _in_use(self, device: Device) -> bool:
        return device.id in self.state.exclusive or self._exclusive.get(device.id, 0) > 0

    def capacity_in_use(self, device: Device) -> bool:
        return device.id in self.state.shared or bool(self._sharing.get(device.id))

    def _capacity_ok(self, request: Request, device: Device) -> dict[str, Amount] | None:
        consumed = consumption(request.capacity, device.capacity)
        if consumed is None:
            return None
        in_use = [self.state.shared.get(device.id, {}), *self._sharing.get(device.id, ())]
        return consumed if fits(consumed, device.capacity, *in_use) else None

    def other_tenant(self, claim: Claim, request: Request, device: Device) -> Tenant | None:
        """A tenant holding shares of the device that the claim's share may not meet (None: it may
        join them, driver/claims/tenancy.py); admin access holds nothing, so it joins any. The
        claims of one search are taken as one tenant (callers search one claim at a time)."""
        held = self.state.tenants.get(device.id)
        if not held or request.admin_access:
            return None
        mine = Tenant(self.classes[request.class_name].tenancy(device.id[0]), claim.namespace, claim.uid)
        return next((tenant for tenant, count in held.items() if count > 0 and not may_meet(mine, tenant)), None)

    def pool_of(self, device: Device) -> Pool:
        return self._pool_of[device.id[:2]]

    def available_counters(self, pool: Pool) -> dict[str, dict[str, Amount]]:
        """The pool's counters less what allocated devices draw (before this attempt)."""
        if pool.id not in self._available:
            self._available[pool.id] = self.state.counters_left(pool)
        return self._available[pool.id]

    def _draw_counters(self, device: Device, sign: int) -> None:
        drawn = self._drawn.setdefault(device.id[:2], {})
        for counter_set, counters in device.consumes:
            target = drawn.setdefault(counter_set, {})
            for name, value in counters.items():
                target[name] = target.get(name, 0) + sign * value

    def _counters_fit(self, pool: Pool) -> bool:
        drawn = self._drawn.get(pool.id, {})
        return all(
            value >= drawn.get(set_name, {}).get(name, 0)
            for set_name, counters in self.available_counters(pool).items()
            for name, value in counters.items()
        )

    # --- the search (upstream: allocateOne / allocateDevice) --------------------------------------

    def allocate(self, claims: Sequence[Claim], budget: SearchBudget | None = None) -> list[dict[str, Any]] | None:
        """Allocation results for all `claims` on this node, or None when they do not fit.
        Raises AllocationError where upstream returns an error, SearchBudgetExceeded when the
        search spends the rest of `budget` (None: unbounded)."""
        self._claims = list(claims)
        self._requests: list[list[list[_Candidates]]] = [
            [[self._candidates(r, claim) for r in alternatives] for alternatives in claim.requests]
            for claim in self._claims
        ]
        if self._hopeless():
            return None
        self._chosen: list[list[Chosen]] = [[] for _ in self._claims]
        self._constraint_state = [[None for _ in claim.constraints] for claim in self._claims]
        self._selected: dict[tuple[int, int], int] = {}
        # A plain int on the allocator, not the budget's field: it is decremented in the innermost loop.
        self._budget, self._steps_left = budget, _UNBOUNDED if budget is None else budget.steps - budget.spent
        try:
            if not self._claim(0):
                return None
        finally:
            if budget is not None:
                budget.spent = min(budget.steps, budget.steps - self._steps_left)
        return [self._result(i) for i in range(len(self._claims))]

    def _hopeless(self) -> bool:
        """Whether a request has fewer candidates than it asks for, in each of its alternatives:
        nothing fits, and searching the requests before it (n shared requests: 8^n steps on a DGX
        H100) cannot change that. Only where upstream's search would meet no error before it
        knows (a selector failing on a device, an `All` request's constraint), which it reports."""
        for claim, alternatives_of in zip(self._claims, self._requests, strict=True):
            for alternatives in alternatives_of:
                if any(c.errors or (c.request.mode == "All" and claim.constraints) for c in alternatives):
                    return False
                if all(len(c.devices) < _least(c.request) for c in alternatives):
                    return True
        return False

    def _out_of_steps(self) -> None:
        assert self._budget is not None  # unbounded without one
        self._budget.exhausted = True
        raise SearchBudgetExceeded(self._budget.reason(self._claims))

    def _claim(self, claim_index: int) -> bool:
        if claim_index >= len(self._claims):
            return True
        return self._request(claim_index, 0)

    def _request(self, claim_index: int, request_index: int) -> bool:
        if request_index >= len(self._requests[claim_index]):
            return self._claim(claim_index + 1)
        for sub_index, candidates in enumerate(self._requests[claim_index][request_index]):
            if self._devices(claim_index, request_index, candidates, 0, 0):
                self._selected[claim_index, request_index] = sub_index
                return True
        return False

    def _devices(self, claim_index: int, request_index: int, candidates: _Candidates, placed: int, start: int) -> bool:
        request = candidates.request
        if request.mode == "All":
            if not candidates.devices:
                return False
            needed = len(candidates.devices)
        else:
            needed = request.count
        if placed >= needed:
            return self._request(claim_index, request_index + 1)
        if needed - placed > MAX_RESULTS_PER_CLAIM - len(self._chosen[claim_index]):
            return False
        if request.mode == "All":
            self._steps_left -= 1
            if self._steps_left < 0:
                self._out_of_steps()
            device = candidates.devices[placed]
            undo = self._take(claim_index, request, device)
            if undo is None:
                return False
            if self._devices(claim_index, request_index, candidates, placed + 1, 0):
                return True
            undo()
            return False
        for position in range(start, len(candidates.devices)):
            self._steps_left -= 1
            if self._steps_left < 0:
                self._out_of_steps()
            device = candidates.devices[position]
            if not request.admin_access and self._in_use(device):
                continue
            if id(device) in candidates.errors:
                raise SearchOrderError(candidates.errors[id(device)])
            if self._capacity_ok(request, device) is None:
                continue
            undo = self._take(claim_index, request, device)
            if undo is None:
                continue
            if self._devices(claim_index, request_index, candidates, placed + 1, position + 1):
                return True
            undo()
        return False

    def _take(self, claim_index: int, request: Request, device: Device) -> Callable[[], None] | None:
        claim = self._claims[claim_index]
        shared = device.allow_multiple_allocations
        if self._in_use(device) and not request.admin_access:
            return None
        if shared and self.state.tenants and self.other_tenant(claim, request, device) is not None:
            return None  # another tenant's shares: prepare would refuse it
        pool = self._pool_of[device.id[:2]]
        draws = bool(device.consumes) and not (shared and self.capacity_in_use(device))
        if draws:
            self._draw_counters(device, +1)
            if not self._counters_fit(pool):
                self._draw_counters(device, -1)
                return None
        undo_steps: list[Callable[[], object]] = []  # what each returns is dropped
        if draws:
            undo_steps.append(lambda: self._draw_counters(device, -1))

        def undo() -> None:
            for step in reversed(undo_steps):
                step()

        if request.untolerated_taints(device):
            undo()
            return None
        for index, constraint in enumerate(claim.constraints):
            if not self._add_constraint(claim_index, index, constraint, request, device):
                undo()
                if request.mode == "All":
                    raise SearchOrderError(
                        f"claim {claim.key}, request {request.full_name}: cannot add device "
                        f"{'/'.join(device.id)} because a claim constraint would not be satisfied"
                    )
                return None
            undo_steps.append(functools.partial(self._remove_constraint, claim_index, index, constraint, request))
        if not shared:
            self._exclusive[device.id] = self._exclusive.get(device.id, 0) + 1
            undo_steps.append(lambda: self._exclusive.__setitem__(device.id, self._exclusive[device.id] - 1))
        consumed = self._capacity_ok(request, device)
        if consumed is None:
            undo()
            return None
        chosen = Chosen(request, device)
        if shared:
            chosen.share_id, chosen.consumed = str(uuid.uuid4()), consumed
            shares = self._sharing.setdefault(device.id, [])
            shares.append(consumed)
            undo_steps.append(shares.pop)
        self._chosen[claim_index].append(chosen)
        undo_steps.append(self._chosen[claim_index].pop)
        return undo

    def _add_constraint(
        self, claim_index: int, index: int, constraint: Constraint, request: Request, device: Device
    ) -> bool:
        if not constraint.applies(request):
            return True
        name = constraint.match_attribute or constraint.distinct_attribute
        value = device.attribute(name)
        if value is None:
            return False
        state = self._constraint_state[claim_index]
        if constraint.match_attribute:
            current = state[index]  # (value, count) of the devices so far
            if current is not None and current[1] > 0:
                if current[0] != value:
                    return False
                state[index] = (current[0], current[1] + 1)
            else:
                state[index] = (value, 1)
            return True
        seen = state[index] if state[index] is not None else []
        if value in seen:
            return False
        state[index] = [*seen, value]
        return True

    def _remove_constraint(self, claim_index: int, index: int, constraint: Constraint, request: Request) -> None:
        if not constraint.applies(request):
            return
        state = self._constraint_state[claim_index]
        if constraint.match_attribute:
            value, count = state[index]
            state[index] = (value, count - 1)
        else:
            state[index] = state[index][:-1]

    # --- the result -------------------------------------------------------------------------------

    def _result(self, claim_index: int) -> dict[str, Any]:
        results = []
        for chosen in self._chosen[claim_index]:
            request = chosen.request
            result: dict[str, Any] = {
                "request": request.full_name,
                "driver": chosen.device.id[0],
                "pool": chosen.device.id[1],
                "device": chosen.device.id[2],
            }
            if request.admin_access:
                result["adminAccess"] = True
            if request.raw_tolerations:
                result["tolerations"] = list(request.raw_tolerations)
            if chosen.share_id is not None:
                result["shareID"] = chosen.share_id
                if chosen.consumed:
                    result["consumedCapacity"] = {k: format_amount(v) for k, v in sorted(chosen.consumed.items())}
            results.append(result)
        allocation: dict[str, Any] = {"devices": {"results": results}}
        configs = self._configs(claim_index)
        if configs:
            allocation["devices"]["config"] = configs
        selector = self._node_selector(claim_index)
        if selector is not None:
            allocation["nodeSelector"] = selector
        return allocation

    def _selected_requests(self, claim_index: int) -> list[Request]:
        claim = self._claims[claim_index]
        return [claim.requests[i][self._selected.get((claim_index, i), 0)] for i in range(len(claim.requests))]

    def _configs(self, claim_index: int) -> list[dict[str, Any]]:
        claim = self._claims[claim_index]
        selected = self._selected_requests(claim_index)
        configs: list[dict[str, Any]] = []
        by_class: dict[str, list[dict[str, Any]]] = {}
        for request in selected:
            if request.class_name in by_class:
                for entry in by_class[request.class_name]:
                    entry["requests"].append(request.full_name)
                continue
            entries = [
                {"source": "FromClass", "requests": [request.full_name], **config}
                for config in self.classes[request.class_name].configs
            ]
            by_class[request.class_name] = entries
            configs.extend(entries)
        names = {r.base_name for r in selected} | {r.full_name for r in selected}
        for config in claim.configs:
            requests = config.get("requests") or []
            if not requests or any(name in names for name in requests):
                configs.append({"source": "FromClaim", **config, "requests": list(requests)})
        for entry in configs:
            covers_all = all(r.base_name in entry["requests"] or r.full_name in entry["requests"] for r in selected)
            if not entry["requests"] or covers_all:
                del entry["requests"]
        return configs

    def _node_selector(self, claim_index: int) -> dict[str, Any] | None:
        fields: list[dict[str, Any]] = []
        expressions: list[dict[str, Any]] = []
        for chosen in self._chosen[claim_index]:
            placement = chosen.device.placement
            if placement.node_name or chosen.device.binds_to_node:
                by_name = {"key": "metadata.name", "operator": "In", "values": [self.node.name]}
                return {"nodeSelectorTerms": [{"matchFields": [by_name]}]}
            terms = (placement.node_selector or {}).get("nodeSelectorTerms") or []
            if len(terms) > 1:
                raise AllocationError(f"unsupported ResourceSlice.NodeSelector with {len(terms)} terms")
            for term in terms:
                for source, target in ((term.get("matchFields"), fields), (term.get("matchExpressions"), expressions)):
                    for requirement in source or ():
                        if requirement not in target:
                            target.append(requirement)
        if not fields and not expressions:
            return None
        merged: dict[str, Any] = {}
        if expressions:
            merged["matchExpressions"] = expressions
        if fields:
            merged["matchFields"] = fields
        return {"nodeSelectorTerms": [merged]}
