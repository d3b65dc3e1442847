"""The driver's feature gates (`--feature-gates Name=true,...`): parts of fgpu that rely on a
Kubernetes feature a cluster may not have turned on. With the cluster's gate off the API server
drops the fields these devices need, so the driver must not publish them."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from driver.inventory.sharing import DeviceKind, SharingConfig


class FeatureGateError(ValueError):
    pass


@dataclass(frozen=True)
class FeatureGate:
    default: bool
    needs: str  # what the cluster must have for it
    kinds: frozenset[DeviceKind] = frozenset()  # device kinds that are not published without it


PARTITIONABLE_DEVICES = "PartitionableDevices"
CONSUMABLE_CAPACITY = "ConsumableCapacity"
GATES: dict[str, FeatureGate] = {
    # Counters keep a GPU's whole device, MIG placements and shares apart: without them only one
    # kind per GPU can be offered, and not MIG (its placements overlap).
    PARTITIONABLE_DEVICES: FeatureGate(
        True, "DRAPartitionableDevices (kube-apiserver, kube-scheduler)", frozenset({"mig", "mig-mps", "mig-timeslice"})
    ),
    CONSUMABLE_CAPACITY: FeatureGate(
        True,
        "DRAConsumableCapacity (kube-apiserver, kube-scheduler, kubelet)",
        frozenset({"mps", "timeslice", "mig-mps", "mig-timeslice"}),
    ),
}


@dataclass(frozen=True)
class FeatureGates:
    overrides: dict[str, bool] = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str) -> FeatureGates:
        """`Name=true,Other=false`, as Kubernetes components take them."""
        overrides = {}
        for item in filter(None, (part.strip() for part in text.split(","))):
            name, sep, value = item.partition("=")
            if name not in GATES:
                raise FeatureGateError(f"--feature-gates: unknown gate {name!r}; known: {', '.join(sorted(GATES))}")
            if not sep or value.lower() not in ("true", "false"):
                raise FeatureGateError(f"--feature-gates: {item!r} must be {name}=true or {name}=false")
            overrides[name] = value.lower() == "true"
        return cls(overrides)

    def enabled(self, name: str) -> bool:
        return self.overrides.get(name, GATES[name].default)

    def restrict(self, sharing: SharingConfig) -> SharingConfig:
        """The sharing configuration with what a disabled gate rules out taken away."""
        unavailable = frozenset().union(*(g.kinds for n, g in GATES.items() if not self.enabled(n)))
        default = sharing.default - unavailable
        per_gpu = {index: kinds - unavailable for index, kinds in sharing.per_gpu.items()}
        offers = [("every GPU", sharing.default, default)] + [
            (f"GPU {i}", sharing.per_gpu[i], kinds) for i, kinds in sorted(per_gpu.items())
        ]
        for where, asked, kinds in offers:
            if asked and not kinds:  # would publish nothing there, without a word
                raise FeatureGateError(
                    f"{self.describe()}: {where} offers only {', '.join(sorted(asked))}, which the disabled gate(s) "
                    "rule out; offer another kind (--offer, --sharing-config) or enable the gate"
                )
        counters = self.enabled(PARTITIONABLE_DEVICES)
        if not counters:
            for where, _, kinds in offers:
                if len(kinds) > 1:
                    raise FeatureGateError(
                        f"{PARTITIONABLE_DEVICES}=false: {where} offers {', '.join(sorted(kinds))}; without shared "
                        "counters nothing keeps one GPU's devices apart, so offer one kind per GPU "
                        "(--offer, --sharing-config)"
                    )
        return replace(sharing, default=default, per_gpu=per_gpu, shared_counters=counters)

    def describe(self) -> str:
        return ", ".join(f"{name}={str(self.enabled(name)).lower()}" for name in sorted(GATES))
