"""`fgpu plan`: a dry run of the allocator over what users keep in their manifests.

In: ResourceClaims, ResourceClaimTemplates and the workloads whose pods use them, DeviceClasses,
ResourceSlices and Nodes, from files, folders, stdin, and a live cluster's published objects and
allocated claims (read only). Each claim is planned as it would be made (a pod's claim from a
template as kube-controller-manager names it) and allocated as kube-scheduler or fgpu's controller
would (gangs all or none), in input order, gangs last. Out: per claim its devices or why none fit,
one line per object not planned and why, and what is left free per node."""

from __future__ import annotations

import contextlib
import json
import re
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TextIO, TypeVar

from driver.allocator.cluster import ClusterAllocator, Failure, Placement, Snapshot
from driver.allocator.explain import node_picture
from driver.allocator.model import (
    Claim,
    DeviceClass,
    ObjectError,
    claim_from_object,
    class_from_object,
    slice_from_object,
)
from driver.allocator.policies import DEFAULT_POLICY, Policy
from driver.allocator.pools import Node
from driver.allocator.state import AllocatedState
from driver.claims.classes import ours
from driver.cli.plan_frameworks import framework_pods
from driver.cli.plan_inputs import (
    FRAMEWORK_KINDS,
    WORKLOAD_KINDS,
    ClaimTemplate,
    Manifest,
    NotPlanned,
    Pod,
    PodClaim,
    Ref,
    claim_object,
    claim_template,
    cluster_manifests,
    node_of,
    placement_fields,
    pods_of,
    read_manifests,
)
from driver.common.flags import DEFAULT_DRIVER_NAME
from driver.scheduling.nodefit import NodeFacts, NodeRoom, PodNeeds
from driver.scheduling.opt_in import GANG_LABEL, OPT_IN_LABEL, OPT_IN_VALUE, gang_of
from driver.scheduling.units import (
    Gang,
    Group,
    Lone,
    claim_opted_in,
    gang_incomplete,
    group_incomplete,
    group_size_unreadable,
    group_unplaced,
    size_unreadable,
)
from driver.scheduling.units import units as scheduling_units

T = TypeVar("T")
DRIVER_SELECTOR = re.compile(r"""device\.driver\s*==\s*["']([^"']+)["']""")
READ_KINDS = frozenset({"DeviceClass", "ResourceSlice", "Node"})  # what the plan runs on, not what it plans
NOT_PLANNED = {
    "Workload": "gangs through the Workload API (scheduling.k8s.io) are not planned yet (another issue); "
    "its pods' claims are planned one by one",
    "PodGroup": "gangs through the Workload API (scheduling.k8s.io) are not planned yet (another issue); "
    "its pods' claims are planned one by one",
}
PLANNED_KINDS = (
    "ResourceClaims, and the claims of Pods, Deployments, ReplicaSets, StatefulSets, Jobs, CronJobs, "
    "TrainJobs, JobSets, LeaderWorkerSets, RayClusters, RayJobs"
)
RUNTIME_KINDS = ("TrainingRuntime", "ClusterTrainingRuntime")  # read for the TrainJobs that name them


@dataclass(frozen=True)
class PlanInput:
    paths: tuple[Path, ...]
    kubeconfig: str | None = None  # plan against this cluster's slices, classes, nodes and claims too
    policy: Policy = DEFAULT_POLICY
    driver: str = DEFAULT_DRIVER_NAME


@dataclass(frozen=True)
class Unit:
    """A claim to plan, named as the user sees it."""

    subject: str  # "deployment default/web replica 2: claim gpu from template t", "resourceclaim ml/c"
    claim: Claim
    where: str  # the object it comes from: "<file> document <n>"
    node: str = ""  # placed on this node only (a DaemonSet's pod)
    pods: tuple[PodNeeds, ...] = ()  # the pods that use the claim: it goes where they all fit
    group: str = ""  # an operator's gang (namespace/name) of an opt-in claim: all or none
    group_size: int = 0  # the pods the gang needs together (0: unreadable)
    group_pods: int = 0  # the pods of the gang the input makes


@dataclass(frozen=True)
class Skip:
    what: str
    where: str
    reason: str


@dataclass(frozen=True)
class Outcome:
    unit: Unit
    node: str = ""
    devices: tuple[str, ...] = ()
    allocation: dict[str, Any] | None = None
    error: str = ""


@dataclass
class Plan:
    outcomes: list[Outcome] = field(default_factory=list)
    skipped: list[Skip] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    nodes: dict[str, list[str]] = field(default_factory=dict)

    @property
    def failed(self) -> int:
        return sum(1 for o in self.outcomes if o.error)


def plan(request: PlanInput, stdin: TextIO, out: TextIO, as_json: bool = False) -> int:
    """Prints the plan; 1 when a claim cannot be allocated, else 0 (bad input raises ObjectError)."""
    manifests = cluster_manifests(request.kubeconfig) if request.kubeconfig else []
    result = make_plan(manifests + read_manifests(request.paths, stdin), request.policy, request.driver)
    (_write_json if as_json else _write_text)(result, out)
    return 1 if result.failed else 0


def make_plan(manifests: list[Manifest], policy: Policy, driver: str) -> Plan:
    catalog = Catalog(manifests)
    world = World.build(catalog, policy, driver)
    result = Plan(skipped=list(catalog.skipped), notes=catalog.notes + world.notes())
    units = _units(catalog, world, driver, result)
    result.outcomes = _allocate(world, units, world.room({u.claim.key: u.pods for u in units}))
    result.nodes = {node: node_picture(world.cluster, node) for node in sorted(world.cluster.snapshot.pools)}
    return result


# The input, one object per kind and name


class Catalog:
    """The objects, one per kind and name: of two, the later (as kubectl apply leaves it); the
    input's replaces the cluster's, except that a claim allocated in the cluster stays as it is."""

    def __init__(self, manifests: Iterable[Manifest]) -> None:
        self.objects: dict[Ref, Manifest] = {}
        self.skipped: list[Skip] = []
        self.notes: list[str] = []
        for manifest in manifests:
            self._add(manifest)

    def _add(self, manifest: Manifest) -> None:
        same = self.objects.get(manifest.ref)
        if same is not None and same.from_cluster and manifest.ref.kind == "ResourceClaim" and _allocated(same):
            self.skipped.append(Skip(str(manifest.ref), manifest.where, "already allocated in the cluster (counted)"))
            return
        if same is not None and not same.from_cluster and same.obj != manifest.obj:
            self.notes.append(f"{manifest.ref}: given twice, differently ({same.where}; {manifest.where}): the later")
        self.objects[manifest.ref] = manifest

    def of_kind(self, kind: str) -> list[Manifest]:
        return [m for m in self.objects.values() if m.ref.kind == kind]


def _allocated(manifest: Manifest) -> bool:
    return bool((manifest.obj.get("status") or {}).get("allocation"))


@contextlib.contextmanager
def _reading(manifest: Manifest) -> Iterator[None]:
    """The model's conversions trust the shape the API server guarantees; a hand-written file may
    break it anywhere, so any such failure becomes one line naming the object and where it is."""
    try:
        yield
    except ObjectError as err:
        raise ObjectError(f"{manifest.where}: {err}") from None
    except (AttributeError, KeyError, TypeError, ValueError) as err:
        raise ObjectError(f"{manifest.where}: {manifest.ref}: not a valid {manifest.ref.kind}: {err!r}") from None


def _converted(convert: Callable[[dict[str, Any]], T], manifest: Manifest, obj: dict[str, Any] | None = None) -> T:
    """`convert` of the manifest's object (or of `obj`, made from it)."""
    with _reading(manifest):
        return convert(manifest.obj if obj is None else obj)


# What the claims are allocated on


@dataclass
class World:
    cluster: ClusterAllocator
    nodes: list[Node]  # Nodes given: placement only on these, where the claim's pods fit
    node_facts: list[NodeFacts]
    unused_nodes: list[str]  # nodes that slices name but that are not among the Nodes given
    taken: list[Claim]  # claims allocated already
    pending_in_cluster: int  # claims in the cluster waiting for an allocation (not planned)

    @classmethod
    def build(cls, catalog: Catalog, policy: Policy, driver: str) -> World:
        slices = [_converted(slice_from_object, m) for m in catalog.of_kind("ResourceSlice")]
        classes = {c.name: c for c in (_converted(class_from_object, m) for m in catalog.of_kind("DeviceClass"))}
        nodes = sorted((node_of(m) for m in catalog.of_kind("Node")), key=lambda n: n.name)
        claims = [m for m in catalog.of_kind("ResourceClaim") if _allocated(m)]
        taken = [_converted(claim_from_object, m) for m in claims]
        state = AllocatedState.from_claims(taken, driver)  # with their shares' tenants
        snapshot = Snapshot(slices, nodes) if nodes else Snapshot.from_slices(slices)
        named = {s.placement.node_name for s in slices} - {""}
        pending = sum(1 for m in catalog.of_kind("ResourceClaim") if m.from_cluster and not _allocated(m))
        return cls(
            ClusterAllocator(snapshot, classes, state, policy),
            nodes,
            [_converted(NodeFacts.from_object, m) for m in catalog.of_kind("Node")],
            sorted(named - {n.name for n in nodes}) if nodes else [],
            taken,
            pending,
        )

    @property
    def classes(self) -> dict[str, DeviceClass]:
        return self.cluster.classes

    def room(self, pods_of: dict[str, tuple[PodNeeds, ...]]) -> NodeRoom | None:
        """With Nodes given, what they have left for the planned claims' pods (kube-scheduler's
        checks, driver/scheduling/nodefit.py); without, pods are not checked."""
        return NodeRoom(self.node_facts, pods_of) if self.nodes else None

    def drivers(self) -> set[str]:
        return {pool.driver for pools in self.cluster.snapshot.pools.values() for pool in pools}

    def notes(self) -> list[str]:
        notes = []
        if not self.cluster.snapshot.pools:
            notes.append("no node has devices: give ResourceSlices (fgpu discover -o yaml) or --kubeconfig")
        if not self.classes:
            notes.append("no DeviceClasses: give them (daemonset/deviceclasses.yaml) or --kubeconfig")
        if self.nodes:
            notes.append(
                f"placement only on the {len(self.nodes)} Node(s) given, where the claim's pods fit (cordon, taints, "
                "node selector and affinity, cpu, memory and other requests against allocatable; pods of the input "
                "counted, not those already running on the nodes)"
            )
        if self.unused_nodes:
            notes.append(f"not used, no Node object given for them: the slices of {', '.join(self.unused_nodes)}")
        if self.pending_in_cluster:
            notes.append(f"{self.pending_in_cluster} claim(s) in the cluster wait for an allocation: not planned")
        return notes

    def allocated_members(self) -> dict[str, int]:
        """Gang members allocated already, per gang."""
        counts: dict[str, int] = defaultdict(int)
        for claim in self.taken:
            if claim_opted_in(claim) and (gang := gang_of(claim)) is not None:
                counts[gang[0]] += 1
        return counts


# The claims to plan


def _units(catalog: Catalog, world: World, driver: str, result: Plan) -> list[Unit]:
    """Every claim the input would make, in input order, named as its user sees it; what is not
    planned goes to result.skipped with the reason."""
    pods = _pods(catalog, world, result)
    templates = _templates(catalog)
    users = _check_references(catalog, pods)
    used = _used(pods)
    runtimes = _runtimes(catalog)
    units: list[Unit] = []
    for manifest in catalog.objects.values():
        kind = manifest.ref.kind
        if kind in READ_KINDS or (manifest.from_cluster and manifest.ref not in users):
            continue  # the cluster's objects count, but only the claims the input's pods use are planned
        if kind == "ResourceClaim":
            units.extend(_claim_units(manifest, users.get(manifest.ref, []), _users_needs(pods, manifest.ref), result))
        elif kind == "ResourceClaimTemplate":
            if manifest.ref not in used:
                result.skipped.append(Skip(str(manifest.ref), manifest.where, "no pod in the input uses it"))
        elif manifest.ref in pods:
            units.extend(_workload_units(manifest, pods[manifest.ref], templates, result))
        elif kind in RUNTIME_KINDS:
            if manifest.ref not in runtimes:
                result.skipped.append(Skip(str(manifest.ref), manifest.where, "no TrainJob in the input uses it"))
        elif kind not in WORKLOAD_KINDS + FRAMEWORK_KINDS:
            reason = NOT_PLANNED.get(kind, f"fgpu plan does not plan a {kind}: it plans {PLANNED_KINDS}")
            result.skipped.append(Skip(str(manifest.ref), manifest.where, reason))
    return [u for u in units if _kept(u, world, driver, result)]


def _runtimes(catalog: Catalog) -> set[Ref]:
    """The training runtimes the input's TrainJobs name."""
    named = set()
    for trainjob in catalog.of_kind("TrainJob"):
        ref = (trainjob.obj.get("spec") or {}).get("runtimeRef") or {}
        kind = str(ref.get("kind") or "ClusterTrainingRuntime")
        named.add(Ref(kind, trainjob.ref.namespace if kind == "TrainingRuntime" else "", str(ref.get("name"))))
    return named


def _pods(catalog: Catalog, world: World, result: Plan) -> dict[Ref, list[Pod]]:
    pods: dict[Ref, list[Pod]] = {}
    for manifest in catalog.objects.values():
        framework = manifest.ref.kind in FRAMEWORK_KINDS
        if (manifest.ref.kind not in WORKLOAD_KINDS and not framework) or manifest.from_cluster:
            continue
        try:
            with _reading(manifest):
                made = framework_pods(manifest, catalog.objects.get) if framework else pods_of(manifest, world.nodes)
        except NotPlanned as why:
            result.skipped.append(Skip(str(manifest.ref), manifest.where, str(why)))
            continue
        if not any(pod.claims for pod in made):
            result.skipped.append(Skip(str(manifest.ref), manifest.where, "its pods use no ResourceClaims"))
            continue
        pods[manifest.ref] = made
        if not world.nodes and not framework and (fields := placement_fields(manifest)):
            where = "on each node its nodeSelector matches" if manifest.ref.kind == "DaemonSet" else "on any node"
            result.notes.append(
                f"{manifest.ref}: its pods' {', '.join(fields)} not checked without Nodes in the input; "
                f"their claims are planned {where}"
            )
    return pods


def _templates(catalog: Catalog) -> dict[Ref, tuple[Manifest, ClaimTemplate]]:
    templates = {}
    for manifest in catalog.of_kind("ResourceClaimTemplate"):
        with _reading(manifest):
            templates[manifest.ref] = (manifest, claim_template(manifest))
    return templates


def _check_references(catalog: Catalog, pods: dict[Ref, list[Pod]]) -> dict[Ref, list[str]]:
    """Every claim and template the pods name is in the input; returns each claim's users."""
    users: dict[Ref, list[str]] = defaultdict(list)
    for owner, made in pods.items():
        for pod in made:
            for pod_claim in pod.claims:
                ref = _referenced(pod, pod_claim)
                kind, name = ref.kind, ref.name
                if ref not in catalog.objects:
                    where = " nor in the cluster" if any(m.from_cluster for m in catalog.objects.values()) else ""
                    raise ObjectError(
                        f"{catalog.objects[owner].where}: {owner}: claim {pod_claim.name} names {kind} "
                        f"{pod.namespace}/{name}, which is not in the input{where}"
                    )
                if kind == "ResourceClaim" and str(owner) not in users[ref]:
                    users[ref].append(str(owner))
    return users


def _referenced(pod: Pod, pod_claim: PodClaim) -> Ref:
    """The claim a pod's entry names, or the template it makes one from."""
    if pod_claim.claim:
        return Ref("ResourceClaim", pod.namespace, pod_claim.claim)
    return Ref("ResourceClaimTemplate", pod.namespace, pod_claim.template)


def _used(pods: dict[Ref, list[Pod]]) -> set[Ref]:
    return {_referenced(pod, c) for made in pods.values() for pod in made for c in pod.claims if c.template}


def _users_needs(pods: dict[Ref, list[Pod]], claim: Ref) -> tuple[PodNeeds, ...]:
    """What the pods that name the claim need of a node (all of them run where it is)."""
    return tuple(
        pod.needs
        for made in pods.values()
        for pod in made
        if pod.needs and any(c.claim and _referenced(pod, c) == claim for c in pod.claims)
    )


def _claim_units(manifest: Manifest, users: list[str], needs: tuple[PodNeeds, ...], result: Plan) -> list[Unit]:
    if _allocated(manifest):
        result.skipped.append(Skip(str(manifest.ref), manifest.where, "allocated already (counted as taken)"))
        return []
    subject = str(manifest.ref) + (f" (used by {', '.join(users)})" if users else "")
    return [Unit(subject, _converted(claim_from_object, manifest), manifest.where, pods=needs)]


def _workload_units(
    manifest: Manifest, pods: list[Pod], templates: dict[Ref, tuple[Manifest, ClaimTemplate]], result: Plan
) -> list[Unit]:
    """Per pod, the claims made from templates for it (those it names are planned on their own)."""
    units = []
    in_gang = Counter(pod.gang.name for pod in pods if pod.gang)
    for pod in pods:
        for pod_claim in (c for c in pod.claims if c.template):
            given, template = templates[_referenced(pod, pod_claim)]
            claim = _converted(claim_from_object, given, claim_object(template, pod, pod_claim))
            subject = f"{pod.subject}: claim {pod_claim.name} from template {pod_claim.template}"
            if pod.node and claim_opted_in(claim) and gang_of(claim):
                result.skipped.append(Skip(subject, manifest.where, "a gang of a DaemonSet's pods is not planned"))
                continue
            needs = (pod.needs,) if pod.needs else ()
            unit = Unit(subject, claim, manifest.where, pod.node, needs)
            if pod.gang and claim_opted_in(claim):  # the controller's gang; kube-scheduler's claims go alone
                group = f"{pod.namespace}/{pod.gang.name}"
                subject = f"{subject} (gang {pod.gang.name} of {pod.gang.size})"
                unit = replace(unit, subject=subject, group=group, group_size=pod.gang.size)
                unit = replace(unit, group_pods=in_gang[pod.gang.name])
            units.append(unit)
    return units


def _kept(unit: Unit, world: World, driver: str, result: Plan) -> bool:
    """A claim for another driver's devices is not planned: fgpu plan knows its own, and those of
    drivers whose slices it is given."""
    foreign = _foreign_classes(unit.claim, world, driver)
    if foreign:
        reason = f"for another driver: class {', '.join(foreign)} (give its DeviceClass and ResourceSlices to plan it)"
        result.skipped.append(Skip(unit.subject, unit.where, reason))
        return False
    if gang_of(unit.claim) and not claim_opted_in(unit.claim):
        result.notes.append(
            f"{unit.subject}: labelled {GANG_LABEL} without {OPT_IN_LABEL}={OPT_IN_VALUE}: kube-scheduler "
            "allocates it alone, and so does the plan"
        )
    return True


def _foreign_classes(claim: Claim, world: World, driver: str) -> list[str]:
    """The classes of a request none of whose alternatives fgpu plan can allocate from."""
    drivers = world.drivers() | {driver}
    foreign: list[str] = []
    for alternatives in claim.requests:
        names = [request.class_name for request in alternatives]
        if all(_foreign(name, world.classes, drivers, driver) for name in names):
            foreign.extend(n for n in names if n not in foreign)
    return foreign


def _foreign(name: str, classes: dict[str, DeviceClass], drivers: set[str], driver: str) -> bool:
    device_class = classes.get(name)
    if device_class is None:  # one of ours that is missing is an allocation failure, with its reason
        return not ours(name, driver)
    selected = {d for expression in device_class.selectors for d in DRIVER_SELECTOR.findall(expression)}
    return bool(selected) and not selected & drivers


# Allocation


def _allocate(world: World, units: list[Unit], room: NodeRoom | None) -> list[Outcome]:
    """Lone claims in input order, then gangs all or none (the controller's order,
    driver/scheduling/units.py); reported in input order. With a room, each claim only where its
    pods fit, the pods placed before counted."""
    outcomes: dict[int, Outcome] = {}
    allocated = world.allocated_members()
    for unit in scheduling_units(units, _claim_of, _group_of):
        if isinstance(unit, Lone):
            outcomes[id(unit.member)] = _place(world.cluster, unit.member, room)
        elif isinstance(unit, Gang):
            for outcome in _place_gang(world.cluster, unit, allocated.get(unit.name, 0), room):
                outcomes[id(outcome.unit)] = outcome
        else:
            for outcome in _place_group(world.cluster, unit, room):
                outcomes[id(outcome.unit)] = outcome
    return [outcomes[id(unit)] for unit in units]


def _claim_of(unit: Unit) -> Claim:
    return unit.claim


def _group_of(unit: Unit) -> str | None:
    return unit.group or None


def _place(cluster: ClusterAllocator, unit: Unit, room: NodeRoom | None) -> Outcome:
    if unit.node and unit.node not in cluster.snapshot.pools:
        return Outcome(unit, error=f"node {unit.node} has no devices (no ResourceSlices)")
    outcome = cluster.allocate(unit.claim, [unit.node] if unit.node else None, room)
    if isinstance(outcome, Failure):
        return Outcome(unit, error=outcome.reason)
    cluster.commit(outcome)
    if room is not None:
        room.take(outcome)
    return _placed(unit, outcome)


def _place_gang(cluster: ClusterAllocator, gang: Gang[Unit], allocated: int, room: NodeRoom | None) -> list[Outcome]:
    """As the controller places a gang: nothing until all its claims exist, then all or none."""
    reason = size_unreadable(gang) or gang_incomplete(gang, allocated)
    if reason is None:
        outcome = cluster.allocate_gang([unit.claim for unit in gang.members], room)
        if not isinstance(outcome, Failure):
            by_claim = {id(placement.claim): placement for placement in outcome}
            return [_placed(unit, by_claim[id(unit.claim)]) for unit in gang.members]
        reason = outcome.reason
    return [Outcome(unit, error=reason) for unit in gang.members]


def _place_group(cluster: ClusterAllocator, group: Group[Unit], room: NodeRoom | None) -> list[Outcome]:
    """An operator's gang (driver/scheduling/framework_gangs.py), as the controller places it:
    nothing until its size in pods exist, then its opt-in claims all or none."""
    first = group.members[0]
    if first.group_size == 0:
        reason = group_size_unreadable(group.name)
    elif first.group_pods < first.group_size:
        reason = group_incomplete(group.name, first.group_pods, first.group_size)
    else:
        outcome = cluster.allocate_gang([unit.claim for unit in group.members], room)
        if not isinstance(outcome, Failure):
            by_claim = {id(placement.claim): placement for placement in outcome}
            return [_placed(unit, by_claim[id(unit.claim)]) for unit in group.members]
        reason = group_unplaced(group.name, first.group_size, outcome.reason)
    return [Outcome(unit, error=reason) for unit in group.members]


def _placed(unit: Unit, placement: Placement) -> Outcome:
    results = placement.allocation["devices"]["results"]
    devices = tuple(r["device"] + (" (share)" if "shareID" in r else "") for r in results)
    return Outcome(unit, placement.node, devices, placement.allocation)


# Output


def _write_text(result: Plan, out: TextIO) -> None:
    before = ""
    for outcome in result.outcomes:
        if outcome.error:  # a gang's members, a workload's replicas: the reason once
            reason = "as above" if outcome.error == before else outcome.error
            out.write(f"{outcome.unit.subject}: cannot allocate: {reason}\n")
        else:
            out.write(f"{outcome.unit.subject}: {outcome.node}: {', '.join(outcome.devices)}\n")
        before = outcome.error
    if result.skipped:
        out.write("\nnot planned:\n")
        for skip in result.skipped:
            out.write(f"  {skip.what}{f' ({skip.where})' if skip.where else ''}: {skip.reason}\n")
    if result.notes:
        out.write("\nnotes:\n" + "".join(f"  {note}\n" for note in result.notes))
    allocated = len(result.outcomes) - result.failed
    out.write(f"\n{allocated} allocated, {result.failed} failed, {len(result.skipped)} not planned\n")
    out.write("\nfree capacity per node:\n")
    for node, lines in result.nodes.items():
        out.write(f"{node}\n" + "".join(f"{line}\n" for line in lines))


def _write_json(result: Plan, out: TextIO) -> None:
    claims = []
    for outcome in result.outcomes:
        entry: dict[str, Any] = {"claim": outcome.unit.claim.key, "subject": outcome.unit.subject}
        if outcome.error:
            entry["error"] = outcome.error
        else:
            entry |= {"node": outcome.node, "devices": list(outcome.devices), "allocation": outcome.allocation}
        claims.append(entry)
    document = {
        "claims": claims,
        "skipped": [{"object": s.what, "where": s.where, "reason": s.reason} for s in result.skipped],
        "notes": result.notes,
        "summary": {
            "allocated": len(result.outcomes) - result.failed,
            "failed": result.failed,
            "skipped": len(result.skipped),
        },
        "nodes": result.nodes,
    }
    json.dump(document, out, indent=2)
    out.write("\n")
