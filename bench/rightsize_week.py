"""Benchmark (issue 42): a simulated week of the bundled example workloads (examples/*.yaml) on mock
H100s, with a usage profile each (steady, bursty, growing): GPU-hours allocated without and with
automatic sizing (each new claim sized by the webhook's Initial mode: its own sizing code on the
template's request, the recommendation and the mock nodes' offers, kind and partition changes included),
out-of-memory events sizing caused, and how many steps each steady workload's recommendation is
from the best size for its true use. Also the usage history's size for 1,000 claims over 7 days.
The profiles are the NVML mock's (driver/nvml/usage_profiles.py): tests run the plugin on the same use.

Each replica's claim lives `--lifetime-h` hours (a rollout, a Job's next run), then a new one is
made; a claim whose processes run out of memory is replaced at once. Claims that are not made from
a template (a ResourceClaim) or whose request is firstAvailable are not sized: they count the same
both ways.

  python -m bench.rightsize_week [--days 7] [--sample-s 60] [--lifetime-h 12] [--json]
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from driver.common.yamlfile import load_yaml_documents
from driver.nvml.usage_profiles import WANDER, WORKLOAD_PROFILES, UsageProfile
from driver.sizing.history import DAY_S, HOUR_S, ClaimRecord, Sample, UsageHistory, Workload, expire, record, to_json
from driver.sizing.initial import size_claim
from driver.sizing.offers import Offers
from driver.sizing.recommend import Policy, WorkloadKey, recommend_workload
from driver.sizing.request import request_size
from driver.sizing.sizes import (
    KIND_OF_CLASS,
    GpuModel,
    Need,
    Size,
    fit,
    gpu_fraction,
    gpu_model,
    memory_limit_mib,
    steps_between,
)

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
PRODUCT = "NVIDIA H100 80GB HBM3"  # examples select H100s; the mock machine dgx-h100
MIB = 2**20


def best(profile: UsageProfile, original: Size, gpu: GpuModel, policy: Policy) -> Size:
    """The size the rules would give a steady profile with its true use known: the peak and p95 of
    a uniform +-WANDER wander."""
    memory = int(profile.memory_mib * (1 + WANDER) * (1 + policy.memory_margin))
    p95 = profile.compute * (1 + WANDER * 0.9)
    return fit(original, Need(memory, p95 * (1 + policy.compute_margin)), gpu)


@dataclass(frozen=True)
class ExampleWorkload:
    file: str
    kind: str
    name: str
    template: str  # "" for a ResourceClaim: not sized
    request: str
    devices: int  # replicas times the request's count
    size: Size
    sizable: bool
    spec: dict[str, Any] = field(default_factory=dict, compare=False)  # the request as its template writes it

    @property
    def label(self) -> str:
        return f"{self.kind}/{self.name}"


@dataclass
class Outcome:
    workload: str
    profile: str
    original: str
    final: str = ""
    gpu_hours_off: float = 0.0
    gpu_hours_auto: float = 0.0
    ooms_off: int = 0
    ooms_by_sizing: int = 0
    sized: bool = False
    steps_from_best: int | None = None
    sizes_used: list[str] = field(default_factory=list)


def example_workloads(gpu: GpuModel) -> list[ExampleWorkload]:
    """The workloads of examples/*.yaml with a claim of ours: each pod owner (or bare pod) and the
    template (or claim) its pods use, the size it asks for."""
    found = []
    for path in sorted(EXAMPLES.glob("*.yaml")):
        docs = [d for d in load_yaml_documents(path) if isinstance(d, dict)]
        requests = {d["metadata"]["name"]: _first_request(d) for d in docs if d["kind"] in _CLAIM_KINDS}
        for doc in docs:
            for kind, name, replicas, claim_refs in _pod_users(doc):
                for ref in claim_refs:
                    template = ref.get("resourceClaimTemplateName", "")
                    request = requests[template or ref["resourceClaimName"]]
                    size, sizable = _size_of(request, gpu)
                    devices = replicas * int(request.get("exactly", {}).get("count", 1))
                    found.append(
                        ExampleWorkload(
                            path.name,
                            kind,
                            name,
                            template,
                            request["name"],
                            devices,
                            size,
                            sizable and bool(template),
                            request,
                        )
                    )
    return found


_CLAIM_KINDS = ("ResourceClaimTemplate", "ResourceClaim")


def _first_request(doc: dict[str, Any]) -> dict[str, Any]:
    spec = doc["spec"]["spec"] if doc["kind"] == "ResourceClaimTemplate" else doc["spec"]
    request: dict[str, Any] = spec["devices"]["requests"][0]
    return request


def _pod_users(doc: dict[str, Any]) -> Iterator[tuple[str, str, int, list[dict[str, Any]]]]:
    name, spec = doc["metadata"]["name"], doc.get("spec", {})
    if doc["kind"] == "Pod":
        yield "Pod", name, 1, spec.get("resourceClaims", [])
    elif doc["kind"] in ("Deployment", "Job"):
        replicas = spec.get("replicas", spec.get("parallelism", 1))
        yield doc["kind"], name, replicas, spec["template"]["spec"].get("resourceClaims", [])


def _size_of(request: dict[str, Any], gpu: GpuModel) -> tuple[Size, bool]:
    """The size a request asks for; firstAvailable counts as its first choice, not sized."""
    if "firstAvailable" in request:
        return Size(KIND_OF_CLASS[request["firstAvailable"][0]["deviceClassName"]]), False
    return request_size(request["exactly"], gpu), True


def offered(gpu: GpuModel) -> Offers:
    """What the mock DGX H100 nodes publish: whole GPUs, MPS and time-sliced shares, every MIG
    profile, and MPS shares inside each (driver/inventory/devices.py)."""
    kinds: list[tuple[str, str | None]] = [("whole", None), ("mps", None), ("timeslice", None)]
    kinds += [(kind, option.name) for option in gpu.mig_ladder for kind in ("mig", "mig-mps")]
    return Offers(frozenset((gpu.product_name, kind, profile) for kind, profile in kinds))


def simulate(
    workload: ExampleWorkload, profile: UsageProfile, days: int, sample_s: int, lifetime_h: int, policy: Policy
) -> Outcome:
    gpu = gpu_model(PRODUCT)
    outcome = Outcome(workload.label, profile.shape, workload.size.describe(), sized=workload.sizable)
    for auto in (False, True):
        history = UsageHistory(sample_s)
        key = WorkloadKey("bench", Workload(workload.kind, workload.name), workload.template, workload.request)
        size, serial = workload.size, 0
        pending: list[Sample] = []  # this hour's samples, not yet in the history
        claims = [_claim(workload, key, f"{d}-0", size) for d in range(workload.devices)]
        for t in range(0, days * DAY_S, sample_s):
            renew = t > 0 and t % (lifetime_h * HOUR_S) == 0
            if auto and t % HOUR_S == 0 and pending:  # the plugin closes a bucket each hour
                history, pending = record(history, claims, pending), []
            for index, claim in enumerate(claims):
                memory, compute = profile.at(t, f"{workload.label}/{index}")  # each replica its own wander
                limit = memory_limit_mib(claim.size, gpu)
                oom = memory > limit
                fraction = gpu_fraction(claim.size, gpu) * sample_s / HOUR_S
                if not auto:
                    outcome.gpu_hours_off += fraction
                    outcome.ooms_off += oom
                    continue
                pending.append(Sample(claim.uid, t, min(memory, limit), compute, oom))
                outcome.gpu_hours_auto += fraction
                outcome.ooms_by_sizing += oom and memory <= memory_limit_mib(workload.size, gpu)
                if (renew or oom) and workload.sizable:
                    history, pending = record(history, claims, pending), []
                    serial += 1
                    size = _webhook_size(workload, history, key, t, policy)[1]
                    claims[index] = _claim(workload, key, f"{index}-{serial}", size, original=workload.size)
                    if size.describe() not in outcome.sizes_used:
                        outcome.sizes_used.append(size.describe())
        if auto:
            history = record(history, claims, pending)
            if workload.sizable:
                recommended, final = _webhook_size(workload, history, key, days * DAY_S, policy)
            else:
                recommended = final = workload.size
            outcome.final = final.describe()
            if profile.shape == "steady" and workload.sizable:  # the rules' distance, sized or not
                outcome.steps_from_best = steps_between(recommended, best(profile, workload.size, gpu, policy), gpu)
    return outcome


def _claim(
    workload: ExampleWorkload, key: WorkloadKey, uid: str, size: Size, original: Size | None = None
) -> ClaimRecord:
    return ClaimRecord(
        uid, key.namespace, uid, key.workload, key.template, key.request, 0, PRODUCT, size, original=original
    )


def _webhook_size(
    workload: ExampleWorkload, history: UsageHistory, key: WorkloadKey, now: int, policy: Policy
) -> tuple[Size, Size]:
    """The recommendation as of `now`, and the size the webhook's Initial mode gives a new claim of
    the workload's template: its pure sizing (driver/sizing/initial.py) on the template's request."""
    claims = list(expire(history, now).claims.values())
    rec = recommend_workload(key, claims, history.sample_seconds, now, policy)
    claim = {"spec": {"devices": {"requests": [workload.spec]}}}
    sizing = size_claim(claim, {workload.request: rec}, now, policy, offered(gpu_model(PRODUCT)))
    return rec.recommended, sizing.sized[0].after if sizing.sized else workload.size


def history_size(claims: int = 1000, days: int = 7) -> dict[str, int]:
    """Bytes of the history of `claims` claims each held all `days` days (the worst case: buckets
    per claim do not depend on the sample rate), as JSON and gzipped JSON."""
    workload = Workload("Deployment", "inference")
    records = [
        ClaimRecord(f"{i:08d}-0000-0000-0000-000000000000", "team-a", f"inference-{i}-gpu-x7k2p", workload,
                    "inference-share", "gpu", 0, PRODUCT, Size("mps", 8192, 10))
        for i in range(claims)
    ]  # fmt: skip
    rng = random.Random(1)
    samples = [
        Sample(r.uid, t, rng.randrange(1000, 4000), rng.uniform(0, 30))
        for r in records
        for t in range(0, days * DAY_S, 1800)
    ]
    text = to_json(expire(record(UsageHistory(10), records, samples), days * DAY_S))
    return {"claims": claims, "days": days, "json_bytes": len(text), "gzip_bytes": len(gzip.compress(text.encode()))}


def run(days: int, sample_s: int, lifetime_h: int, policy: Policy = Policy()) -> dict[str, Any]:
    gpu = gpu_model(PRODUCT)
    outcomes = [
        simulate(w, WORKLOAD_PROFILES[w.label], days, sample_s, lifetime_h, policy) for w in example_workloads(gpu)
    ]
    off, auto = sum(o.gpu_hours_off for o in outcomes), sum(o.gpu_hours_auto for o in outcomes)
    steady = [o.steps_from_best for o in outcomes if o.profile == "steady" and o.sized]
    return {
        "days": days,
        "sample_s": sample_s,
        "lifetime_h": lifetime_h,
        "gpu_hours_off": round(off, 1),
        "gpu_hours_auto": round(auto, 1),
        "reduction": round(1 - auto / off, 3),
        "ooms_by_sizing": sum(o.ooms_by_sizing for o in outcomes),
        "ooms_without_sizing": sum(o.ooms_off for o in outcomes),
        "steady_max_steps": max((s for s in steady if s is not None), default=0),
        "steady_not_comparable": sum(1 for s in steady if s is None),
        "workloads": [asdict(o) for o in outcomes],
    }


def render(result: dict[str, Any]) -> str:
    lines = [
        f"{'workload':<22} {'profile':<8} {'original':<22} {'final':<22} {'GPU-h off':>9} {'GPU-h auto':>10} OOM steps"
    ]
    for o in result["workloads"]:
        steps = "-" if o["steps_from_best"] is None else str(o["steps_from_best"])
        lines.append(
            f"{o['workload']:<22} {o['profile']:<8} {o['original']:<22} {o['final']:<22} "
            f"{o['gpu_hours_off']:>9.1f} {o['gpu_hours_auto']:>10.1f} {o['ooms_by_sizing']:>3} {steps:>5}"
        )
    lines.append(
        f"GPU-hours {result['gpu_hours_off']} -> {result['gpu_hours_auto']} "
        f"({result['reduction']:.1%} fewer; target >= 30%), "
        f"OOMs caused by sizing {result['ooms_by_sizing']} (target 0), steady workloads at most "
        f"{result['steady_max_steps']} step(s) from the best (target <= 1)"
    )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--days", type=int, default=7)
    parser.add_argument("--sample-s", type=int, default=60)
    parser.add_argument("--lifetime-h", type=int, default=12)
    parser.add_argument("--history-claims", type=int, default=1000, help="claims in the history-size estimate")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = run(args.days, args.sample_s, args.lifetime_h)
    result["history_size"] = history_size(args.history_claims, 7)
    if args.json:
        print(json.dumps(result, indent=2))
        return
    size = result["history_size"]
    print(render(result), end="")
    print(
        f"history of {size['claims']} claims x {size['days']} days: "
        f"{size['json_bytes']:,} B JSON, {size['gzip_bytes']:,} B gzipped"
    )


if __name__ == "__main__":
    main()
