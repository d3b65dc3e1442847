"""Benchmark (issue 42): a simulated week of the bundled example workloads (examples/*.yaml) on mock
H100s, with a usage profile each (steady, bursty, growing): GPU-hours allocated without and with
automatic sizing (each new claim sized to the recommendation, as the webhook's Initial mode would),
out-of-memory events sizing caused, and how many steps each steady workload's recommendation is
from the best size for its true use. Also the usage history's size for 1,000 claims over 7 days.

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
import re
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from driver.common.quantity import parse_quantity
from driver.common.yamlfile import load_yaml_documents
from driver.sizing.history import DAY_S, HOUR_S, ClaimRecord, Sample, UsageHistory, Workload, expire, record, to_json
from driver.sizing.recommend import Policy, WorkloadKey, recommend_workload
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
NOISE = 0.02  # steady use wanders +-2% around its level
MIB = 2**20


@dataclass(frozen=True)
class UsageProfile:
    """A workload's true use: `steady` at its level, `bursty` at its level with a spike to
    `burst_mib` / `burst_compute` for 10 minutes every 6 hours, `growing` by `growth_mib_per_day`."""

    shape: str
    memory_mib: int
    compute: float
    burst_mib: int = 0
    burst_compute: float = 0.0
    growth_mib_per_day: int = 0

    def at(self, t: int, rng: random.Random) -> tuple[int, float]:
        wander = 1 + rng.uniform(-NOISE, NOISE)
        if self.shape == "bursty" and t % (6 * HOUR_S) < 600:
            return int(self.burst_mib * wander), self.burst_compute * wander
        memory = self.memory_mib + self.growth_mib_per_day * t / DAY_S
        return int(memory * wander), self.compute * wander

    def best(self, original: Size, gpu: GpuModel, policy: Policy) -> Size:
        """The size the rules would give with the true use known (the steady ones'): the peak and
        p95 of a uniform +-2% wander."""
        need = Need(int(self.memory_mib * (1 + NOISE) * (1 + policy.memory_margin)), 0.0)
        p95 = self.compute * (1 + NOISE * 0.9)
        return fit(original, Need(need.memory_mib, p95 * (1 + policy.compute_margin)), gpu)


# Which example workload behaves how: levels in MiB and percent of the GPU.
PROFILES = {
    "Deployment/inference": UsageProfile("steady", 2048, 4.0),
    "Job/trainer": UsageProfile("bursty", 20_480, 25.0, burst_mib=30_720, burst_compute=35.0),
    "Pod/mig-mps-a": UsageProfile("steady", 3072, 8.0),
    "Pod/mig-mps-b": UsageProfile("bursty", 2048, 5.0, burst_mib=5120, burst_compute=12.0),
    "Pod/mig-pair": UsageProfile("steady", 6144, 10.0),
    "Pod/mig-1g": UsageProfile("steady", 4096, 5.0),
    "Pod/mig-3g": UsageProfile("growing", 10_240, 20.0, growth_mib_per_day=1536),
    "Pod/mps-share": UsageProfile("steady", 2048, 8.0),
    "Pod/cuda-job": UsageProfile("bursty", 15_360, 20.0, burst_mib=25_600, burst_compute=30.0),
    "Pod/inference-small": UsageProfile("bursty", 3072, 6.0, burst_mib=6144, burst_compute=15.0),
    "Pod/inference-large": UsageProfile("steady", 12_288, 20.0),
    "Pod/training-mig": UsageProfile("steady", 25_600, 38.0),
    "Pod/timeslice-a": UsageProfile("steady", 512, 10.0),
    "Pod/timeslice-b": UsageProfile("steady", 512, 10.0),
    "Pod/whole-gpu": UsageProfile("steady", 10_240, 15.0),
    "Pod/h100-or-3g": UsageProfile("steady", 8192, 12.0),
}


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
                            path.name, kind, name, template, request["name"], devices, size, sizable and bool(template)
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
    exactly = request["exactly"]
    kind = KIND_OF_CLASS[exactly["deviceClassName"]]
    capacity = exactly.get("capacity", {}).get("requests", {})
    memory = int(parse_quantity(capacity["memory"])) // MIB if "memory" in capacity else None
    if kind in ("timeslice", "mig-timeslice") and memory is None:
        memory = 1024  # a time-sliced share's default (driver/inventory/devices.py)
    compute = int(capacity["compute"]) if "compute" in capacity else None
    profile = None
    for selector in exactly.get("selectors", []):
        match = re.search(r'profile(?: == |\.startsWith\()"([^"]+)"', selector["cel"]["expression"])
        if match:
            profile = next(o.name for o in gpu.mig_ladder if o.name.startswith(match.group(1)))
    return Size(kind, memory, compute, profile), True


def simulate(
    workload: ExampleWorkload, profile: UsageProfile, days: int, sample_s: int, lifetime_h: int, policy: Policy
) -> Outcome:
    gpu = gpu_model(PRODUCT)
    outcome = Outcome(workload.label, profile.shape, workload.size.describe(), sized=workload.sizable)
    for auto in (False, True):
        history, rng = UsageHistory(sample_s), random.Random(workload.label)
        key = WorkloadKey("bench", Workload(workload.kind, workload.name), workload.template, workload.request)
        size, serial = workload.size, 0
        pending: list[Sample] = []  # this hour's samples, not yet in the history
        claims = [_claim(workload, key, f"{d}-0", size) for d in range(workload.devices)]
        for t in range(0, days * DAY_S, sample_s):
            renew = t > 0 and t % (lifetime_h * HOUR_S) == 0
            if auto and t % HOUR_S == 0 and pending:  # the plugin closes a bucket each hour
                history, pending = record(history, claims, pending), []
            for index, claim in enumerate(claims):
                memory, compute = profile.at(t, rng)
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
                    size = _recommended(history, key, t, policy)
                    claims[index] = _claim(workload, key, f"{index}-{serial}", size, original=workload.size)
                    if size.describe() not in outcome.sizes_used:
                        outcome.sizes_used.append(size.describe())
        if auto:
            history = record(history, claims, pending)
            final = _recommended(history, key, days * DAY_S, policy) if workload.sizable else workload.size
            outcome.final = final.describe()
            if profile.shape == "steady" and workload.sizable:
                outcome.steps_from_best = steps_between(final, profile.best(workload.size, gpu, policy), gpu)
    return outcome


def _claim(
    workload: ExampleWorkload, key: WorkloadKey, uid: str, size: Size, original: Size | None = None
) -> ClaimRecord:
    return ClaimRecord(
        uid, key.namespace, uid, key.workload, key.template, key.request, 0, PRODUCT, size, original=original
    )


def _recommended(history: UsageHistory, key: WorkloadKey, now: int, policy: Policy) -> Size:
    claims = list(expire(history, now).claims.values())
    return recommend_workload(key, claims, history.sample_seconds, now, policy).recommended


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
    outcomes = [simulate(w, PROFILES[w.label], days, sample_s, lifetime_h, policy) for w in example_workloads(gpu)]
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
