"""What users keep in their manifests, read for `fgpu plan`.

Files, folders and stdin of Kubernetes objects in (YAML or JSON, several documents a file, Lists
unpacked), or a live cluster's published objects; out, what the planner works on: the pods each
workload would run and the claim kube-controller-manager would make from a template for each of
them. Kubernetes objects are read here (and in the allocator's model) and nowhere past it."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TextIO

from driver.allocator.model import ObjectError
from driver.allocator.pools import Node
from driver.common.yamlfile import YamlFileError, load_yaml_documents, parse_yaml_documents
from driver.kube.client import ClientKubeApi
from driver.scheduling.framework_gangs import FrameworkGang
from driver.scheduling.nodefit import PodNeeds

STDIN = "-"
CLUSTER = "cluster"  # where an object listed from the API server comes from
SUFFIXES = (".yaml", ".yml", ".json")  # what a folder's manifests end with (as kubectl -f reads them)
DEFAULT_NAMESPACE = "default"  # where kubectl apply puts an object without a namespace
CLUSTER_SCOPED = frozenset(
    {
        "DeviceClass", "ResourceSlice", "DeviceTaintRule", "Node", "Namespace", "PersistentVolume",
        "StorageClass", "PriorityClass", "RuntimeClass", "ClusterRole", "ClusterRoleBinding",
        "CustomResourceDefinition", "ValidatingWebhookConfiguration", "MutatingWebhookConfiguration",
        "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding", "APIService", "IngressClass",
        "ClusterTrainingRuntime",
    }
)  # fmt: skip
POD_CLAIM_ANNOTATION = "resource.kubernetes.io/pod-claim-name"
NAME_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"  # kube-apiserver's generateName suffixes draw from these
# What decides where a pod may run, beyond its claims (pod fit: not planned yet).
PLACEMENT_FIELDS = ("nodeName", "nodeSelector", "affinity", "topologySpreadConstraints")


@dataclass(frozen=True)
class Ref:
    kind: str
    namespace: str  # "" for a cluster-scoped kind
    name: str

    def __str__(self) -> str:
        """As a plan names it: `deployment default/web`, `deviceclass gpu.fgpu.dev`."""
        return f"{self.kind.lower()} {f'{self.namespace}/' if self.namespace else ''}{self.name}"


@dataclass(frozen=True)
class Manifest:
    ref: Ref
    obj: dict[str, Any]  # as given; metadata.namespace filled in for a namespaced kind
    where: str  # "<file>: document <n>", "stdin: document <n>", or CLUSTER

    @property
    def from_cluster(self) -> bool:
        return self.where == CLUSTER


@dataclass(frozen=True)
class PodClaim:
    """One entry of a pod's spec.resourceClaims: a claim by its name, or one made from a template."""

    name: str
    claim: str = ""
    template: str = ""


@dataclass(frozen=True)
class Pod:
    """A pod a workload would run, named as its controller names it (random parts made up)."""

    owner: Ref  # the object the user wrote: the Pod itself, or its Deployment, Job, ...
    replica: int | None  # None for a Pod written as such
    name: str
    claims: tuple[PodClaim, ...]
    node: str = ""  # a DaemonSet's pod: the node it runs on
    needs: PodNeeds | None = None  # what kube-scheduler checks of it on a node
    gang: FrameworkGang | None = None  # an operator's pod: the gang its labels put it in
    role: str = ""  # an operator's pod: which of its pods ("worker 2 of group 0", "head")

    def with_needs(self, pod_spec: dict[str, Any]) -> Pod:
        metadata = {"name": self.subject, "namespace": self.namespace}
        return replace(self, needs=PodNeeds.from_object({"metadata": metadata, "spec": pod_spec}))

    @property
    def namespace(self) -> str:
        return self.owner.namespace

    @property
    def subject(self) -> str:
        if self.node:
            return f"{self.owner} on node {self.node}"
        if self.role:
            return f"{self.owner} {self.role}"
        return str(self.owner) if self.replica is None else f"{self.owner} replica {self.replica}"


@dataclass(frozen=True)
class ClaimTemplate:
    ref: Ref
    labels: dict[str, str]
    annotations: dict[str, str]
    spec: dict[str, Any]  # the spec of each claim made from it


class NotPlanned(Exception):
    """An object fgpu plan reads but makes no pods of; the message says why."""


# Reading


def read_manifests(paths: Iterable[Path], stdin: TextIO) -> list[Manifest]:
    """Every object in the files (a folder: its .yaml, .yml and .json files; `-`: stdin), in order."""
    manifests: list[Manifest] = []
    for name, documents in _documents(paths, stdin):
        for number, document in enumerate(documents, 1):
            if document:
                manifests.extend(_unpacked(document, f"{name}: document {number}"))
    return manifests


def _documents(paths: Iterable[Path], stdin: TextIO) -> Iterator[tuple[str, list[Any]]]:
    for path in paths:
        if str(path) == STDIN:
            yield "stdin", _not_empty(_loaded(parse_yaml_documents, stdin.read(), "stdin"), "stdin")
        elif path.is_dir():
            files = sorted(p for p in path.iterdir() if p.suffix in SUFFIXES and p.is_file())
            if not files:
                raise ObjectError(f"{path}: no .yaml, .yml or .json files in it; give a folder of manifests")
            yield from ((str(file), _loaded(load_yaml_documents, file)) for file in files)
        else:
            yield str(path), _not_empty(_loaded(load_yaml_documents, path), str(path))


def _loaded(load: Callable[..., list[Any]], *args: Any) -> list[Any]:
    try:
        return load(*args)
    except YamlFileError as error:
        raise ObjectError(str(error)) from None


def _not_empty(documents: list[Any], name: str) -> list[Any]:
    """A file named on the command line must hold something (in a folder, an empty one is passed over)."""
    if not any(documents):
        raise ObjectError(f"{name}: no objects in it (empty); give a file of Kubernetes objects")
    return documents


def _unpacked(document: Any, where: str) -> list[Manifest]:
    if isinstance(document, dict) and str(document.get("kind", "")).endswith("List"):
        items = document.get("items") or []
        if not isinstance(items, list):
            raise ObjectError(f"{where}: items is a {type(items).__name__}, not a list of objects")
        return [manifest(item, f"{where}, items[{i}]") for i, item in enumerate(items)]
    return [manifest(document, where)]


def manifest(obj: Any, where: str) -> Manifest:
    """An object the planner can name in what it reports: a mapping with a kind and metadata.name."""
    if not isinstance(obj, dict):
        raise ObjectError(f"{where}: expected a Kubernetes object, found {type(obj).__name__}")
    metadata, kind = obj.get("metadata"), obj.get("kind")
    if not isinstance(metadata, dict) or not metadata.get("name") or not isinstance(metadata["name"], str):
        raise ObjectError(f"{where}: {kind or 'object'} without metadata.name; give every object a name")
    if not kind or not isinstance(kind, str):
        raise ObjectError(f"{where}: object {metadata['name']} without kind; give every object its kind")
    namespace = "" if kind in CLUSTER_SCOPED else str(metadata.get("namespace") or DEFAULT_NAMESPACE)
    if namespace and metadata.get("namespace") != namespace:
        obj = {**obj, "metadata": {**metadata, "namespace": namespace}}
    return Manifest(Ref(kind, namespace, metadata["name"]), obj, where)


LISTED = {
    "slices": "ResourceSlice",
    "classes": "DeviceClass",
    "nodes": "Node",
    "claims": "ResourceClaim",
    "templates": "ResourceClaimTemplate",
}


def cluster_manifests(kubeconfig: str) -> list[Manifest]:
    """What a live cluster publishes and holds now (list items carry no kind: it is set here)."""
    api = ClientKubeApi(kubeconfig)  # fgpu plan only ever lists
    try:
        return [
            manifest({**obj, "kind": kind}, CLUSTER)
            for lister, kind in LISTED.items()
            for page, _ in api.list_pages(lister)
            for obj in page
        ]
    finally:
        api.close()


# Workloads and the pods they run


WORKLOAD_KINDS = ("Pod", "Deployment", "ReplicaSet", "StatefulSet", "Job", "CronJob", "DaemonSet")
# Workload operators' kinds, expanded into their pods by plan_frameworks.py.
FRAMEWORK_KINDS = ("TrainJob", "JobSet", "LeaderWorkerSet", "RayCluster", "RayJob")


def pods_of(workload: Manifest, nodes: Sequence[Node]) -> list[Pod]:
    """The pods a workload runs at once (replicas, a Job's parallelism, a DaemonSet's nodes)."""
    ref = workload.ref
    spec, pod_spec = _specs(workload)
    claims = pod_claims(ref, pod_spec)
    if ref.kind == "Pod":
        pods = [Pod(ref, None, ref.name, claims)]
    elif ref.kind == "DaemonSet":
        chosen = _ds_nodes(ref, pod_spec, nodes)
        pods = [Pod(ref, None, _made_up_name(ref, i), claims, node.name) for i, node in enumerate(chosen)]
    else:
        count = _running(ref, spec)
        if count == 0:
            raise NotPlanned("runs no pods (replicas or parallelism 0)")
        names, indexed = _NAMES[ref.kind], spec.get("completionMode") == "Indexed"
        pods = [Pod(ref, i, names(ref, i, indexed), claims) for i in range(count)]
    return [pod.with_needs(pod_spec) for pod in pods]


def _specs(workload: Manifest) -> tuple[dict[str, Any], dict[str, Any]]:
    """The workload's spec (a CronJob's: that of its Jobs) and its pods' spec."""
    ref, spec = workload.ref, mapping_of(workload.obj.get("spec"), workload.ref, "spec")
    if ref.kind == "Pod":
        return spec, spec
    if ref.kind == "CronJob":
        job_template = mapping_of(spec.get("jobTemplate"), ref, "spec.jobTemplate")
        spec = mapping_of(job_template.get("spec"), ref, "jobTemplate.spec")
    return spec, mapping_of(mapping_of(spec.get("template"), ref, "spec.template").get("spec"), ref, "template.spec")


def _running(ref: Ref, spec: dict[str, Any]) -> int:
    """How many pods run at once: replicas, or a Job's parallelism up to its completions."""
    if ref.kind in ("Job", "CronJob"):
        parallelism = count_of(ref, spec, "parallelism")
        completions = spec.get("completions")
        return parallelism if completions is None else min(parallelism, count_of(ref, spec, "completions"))
    return count_of(ref, spec, "replicas")


def count_of(ref: Ref, spec: dict[str, Any], field: str) -> int:
    value = spec.get(field, 1)
    if value is None:
        return 1
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ObjectError(f"{ref}: spec.{field} must be a whole number, not {value!r}")
    return value


def _ds_nodes(ref: Ref, pod_spec: dict[str, Any], nodes: Sequence[Node]) -> list[Node]:
    if not nodes:
        raise NotPlanned("a DaemonSet runs a pod on each node that fits: give the Nodes (in the files or --kubeconfig)")
    selector = mapping_of(pod_spec.get("nodeSelector") or {}, ref, "nodeSelector")
    chosen = [n for n in nodes if all(n.labels.get(k) == v for k, v in selector.items())]
    if not chosen:
        raise NotPlanned(f"no given Node has the labels of its nodeSelector {selector}")
    return chosen


def made_up(seed: str, length: int) -> str:
    """Stands for a random part of a name (a pod's or claim's suffix): stable, and valid in a name."""
    digest = hashlib.sha256(seed.encode()).digest()
    return "".join(NAME_ALPHABET[b % len(NAME_ALPHABET)] for b in digest[:length])


def _made_up_name(ref: Ref, replica: int) -> str:
    return f"{ref.name}-{made_up(f'{ref}/{replica}', 5)}"


# How each controller names its pods: the Deployment's ReplicaSet adds the pod template's hash,
# a StatefulSet numbers them, an indexed Job puts the index before the suffix.
_NAMES: dict[str, Callable[[Ref, int, bool], str]] = {
    "Deployment": lambda ref, i, _: f"{ref.name}-{made_up(str(ref), 10)}-{made_up(f'{ref}/{i}', 5)}",
    "ReplicaSet": lambda ref, i, _: _made_up_name(ref, i),
    "StatefulSet": lambda ref, i, _: f"{ref.name}-{i}",
    "Job": lambda ref, i, indexed: f"{ref.name}-{i}-{made_up(f'{ref}/{i}', 5)}" if indexed else _made_up_name(ref, i),
    "CronJob": lambda ref, i, _: f"{ref.name}-{made_up(str(ref), 8)}-{made_up(f'{ref}/{i}', 5)}",
}


def pod_claims(ref: Ref, pod_spec: dict[str, Any]) -> tuple[PodClaim, ...]:
    entries = pod_spec.get("resourceClaims") or []
    if not isinstance(entries, list):
        raise ObjectError(f"{ref}: resourceClaims is a {type(entries).__name__}, not a list")
    claims = []
    for i, entry in enumerate(entries):
        entry = entry if isinstance(entry, dict) else {}
        name, claim = entry.get("name"), entry.get("resourceClaimName")
        template = entry.get("resourceClaimTemplateName")
        if not name or bool(claim) == bool(template):
            raise ObjectError(
                f"{ref}: resourceClaims[{i}] needs a name and one of resourceClaimName, resourceClaimTemplateName"
            )
        claims.append(PodClaim(str(name), str(claim or ""), str(template or "")))
    return tuple(claims)


def placement_fields(workload: Manifest) -> list[str]:
    """The fields of a workload's pods that say where they may run (nodeSelector, affinity, ...)."""
    used = [f for f in PLACEMENT_FIELDS if _specs(workload)[1].get(f)]
    return [f for f in used if f != "nodeSelector"] if workload.ref.kind == "DaemonSet" else used


def mapping_of(value: Any, ref: Ref, field: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ObjectError(f"{ref}: {field} is {'missing' if value is None else 'not a mapping'}")
    return value


# Claims made from templates


def claim_template(template: Manifest) -> ClaimTemplate:
    spec = mapping_of(template.obj.get("spec"), template.ref, "spec")
    metadata = spec.get("metadata") or {}
    return ClaimTemplate(
        ref=template.ref,
        labels=dict(metadata.get("labels") or {}),
        annotations=dict(metadata.get("annotations") or {}),
        spec=mapping_of(spec.get("spec"), template.ref, "spec.spec"),
    )


def claim_object(template: ClaimTemplate, pod: Pod, pod_claim: PodClaim) -> dict[str, Any]:
    """The ResourceClaim kube-controller-manager creates for a pod's claim from a template."""
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {
            "name": generated_claim_name(pod.name, pod_claim.name, made_up(f"{pod.name}/{pod_claim.name}", 5)),
            "namespace": pod.namespace,
            "labels": dict(template.labels),
            "annotations": {**template.annotations, POD_CLAIM_ANNOTATION: pod_claim.name},
            "ownerReferences": [{"apiVersion": "v1", "kind": "Pod", "name": pod.name, "controller": True}],
        },
        "spec": template.spec,
    }


def generated_claim_name(pod: str, claim: str, suffix: str) -> str:
    """kube-controller-manager's generateName for a pod's claim (past 57 characters both parts are
    cut in proportion), completed as kube-apiserver completes it (at most 58, then 5 random ones)."""
    base = f"{pod}-{claim}-"
    if len(base) > 57:
        base = pod[: len(pod) * 57 // len(base)] + "-" + claim[: len(claim) * 57 // len(base)]
    return base[:58] + suffix


def node_of(node: Manifest) -> Node:
    labels = (node.obj.get("metadata") or {}).get("labels") or {}
    return Node(node.ref.name, {str(k): str(v) for k, v in labels.items()})
