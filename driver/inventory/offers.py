"""What each GPU offers, and why not: one place for the node's offer.

A GPU offers the kinds of device its sharing configuration names (driver/inventory/sharing.py: --offer,
--sharing-config, --mig-share-profiles, less what disabled feature gates rule out), less what it
cannot make real as it is now:
- kinds it cannot offer at all (no MIG on the GPU; a profile no GPU has) stop the node at start
  (check_offers), rather than publish less, or nothing, without a word;
- kinds its current MIG mode rules out, where switching the mode waits for a GPU reset (Ampere),
  are held back (offer_limit) and said: logged (shortfall) and carried by the GPU's devices in the
  attribute `notOffered` (not_offered_note), which `fgpu status` shows.
node_inventory is what the node publishes now; driver/node/mig_mode_watch.py reads the MIG modes
again while the plugin runs and republishes when what a GPU can offer changed."""

from __future__ import annotations

from dataclasses import dataclass, replace

from driver.common.flags import SettingsError
from driver.inventory.devices import (
    NOT_OFFERED_ATTRIBUTE,
    Attribute,
    CounterSet,
    DeviceTarget,
    Inventory,
    PublishedDevice,
    counter_set_name,
    device_for,
    gpu_counters,
    gpu_targets,
    mig_share_targets,
    node_targets,
)
from driver.inventory.discovery import GpuInfo
from driver.inventory.sharing import ALL_KINDS, MIG_KINDS, DeviceKind, SharingConfig


@dataclass(frozen=True)
class OfferLimit:
    """The kinds a GPU cannot offer as it is now, because prepare could not make them real, and why."""

    kinds: frozenset[DeviceKind]
    reason: str
    # The reason in a device attribute (at most 64 characters), where an admin can act on it.
    note: str = ""


NO_LIMIT = OfferLimit(frozenset(), "")


def offer_limit(gpu: GpuInfo) -> OfferLimit:
    """Prepare switches MIG mode as a device needs it (partitioner/mig.py): on for a MIG device, off
    for whole-GPU use (whole, MPS, time-slicing) once no instance is left. Where a switch waits for
    a GPU reset (Ampere), the GPU can offer only what its current mode allows."""
    if not gpu.mig_capable:
        return OfferLimit(MIG_KINDS, "the GPU has no MIG")
    if not gpu.mig_mode_needs_reset:
        return NO_LIMIT
    if gpu.mig_enabled:
        return OfferLimit(
            frozenset({"whole", "mps", "timeslice"}),
            "MIG mode is on and switching it off needs a GPU reset on this GPU "
            f"(nvidia-smi -i {gpu.index} -mig 0, then reset the GPU)",
            "MIG mode on, switching needs a GPU reset",
        )
    return OfferLimit(
        MIG_KINDS,
        "MIG mode is off and switching it on needs a GPU reset on this GPU "
        f"(nvidia-smi -i {gpu.index} -mig 1, then reset the GPU)",
        "MIG mode off, switching needs a GPU reset",
    )


def _held_back(gpu: GpuInfo, sharing: SharingConfig) -> tuple[list[str], OfferLimit]:
    """The configured kinds the GPU cannot offer as it is now, sorted, and why."""
    limit = offer_limit(gpu)
    return sorted(sharing.offered(gpu.index) & limit.kinds), limit


def shortfall(gpu: GpuInfo, sharing: SharingConfig) -> str | None:
    """Why a GPU offers less than it is configured to, in a line; None when it offers all of it."""
    missing, limit = _held_back(gpu, sharing)
    if not missing:
        return None
    return f"GPU {gpu.index} ({gpu.product_name}) offers no {', '.join(missing)}: {limit.reason}"


def not_offered_note(gpu: GpuInfo, sharing: SharingConfig) -> str | None:
    """What the GPU's devices carry in NOT_OFFERED_ATTRIBUTE, so that `fgpu status` can say why a GPU
    offers less: the kinds held back and the note, e.g. "mig: MIG mode off, switching needs a GPU reset"."""
    missing, limit = _held_back(gpu, sharing)
    return f"{','.join(missing)}: {limit.note}" if missing and limit.note else None


def _with_note(device: PublishedDevice, note: str | None) -> PublishedDevice:
    if note is None:
        return device
    return replace(device, attributes={**device.attributes, NOT_OFFERED_ATTRIBUTE: Attribute("string", note)})


def node_inventory(gpus: list[GpuInfo], sharing: SharingConfig) -> Inventory:
    """Every device and counter set the node offers now, in a stable order."""
    targets = node_targets(gpus, sharing)
    notes = {gpu.index: not_offered_note(gpu, sharing) for gpu in gpus}
    devices = [_with_note(device_for(t), notes[t.gpu.index]) for t in targets if t.kind not in offer_limit(t.gpu).kinds]
    if not sharing.shared_counters:
        return Inventory(devices=[replace(d, consumes={}) for d in devices], counter_sets=[])
    counter_sets = [CounterSet(counter_set_name(gpu), gpu_counters(gpu)) for gpu in sorted(gpus, key=lambda g: g.index)]
    return Inventory(devices=devices, counter_sets=counter_sets)


def check_offers(gpus: list[GpuInfo], sharing: SharingConfig) -> None:
    """Refuse what this node cannot honour rather than publish less, or nothing, without a word:
    a sharing config entry for a GPU it lacks or asking a GPU for a kind it cannot offer, and a
    GPU left with no device at all."""
    indices = sorted(gpu.index for gpu in gpus)
    missing = sorted(set(sharing.per_gpu) - set(indices))
    if missing:
        raise SettingsError(
            f"--sharing-config names GPU index(es) {missing}, but this node's GPUs are {indices}; remove those entries"
        )
    for gpu in gpus:
        unable = sorted(kind for kind in sharing.per_gpu.get(gpu.index, ()) if not _can_offer(gpu, kind, sharing))
        if unable:
            raise SettingsError(
                f"--sharing-config asks GPU {gpu.index} ({gpu.product_name}) for {', '.join(unable)}, which it "
                f"cannot offer; it can offer {_offerable(gpu, sharing)}"
            )
    _check_mig_share_profiles(gpus, sharing)
    idle = [gpu for gpu in gpus if not _targets(gpu, sharing.offered(gpu.index), sharing)]
    if idle:
        first = idle[0]
        raise SettingsError(
            f"GPU(s) {', '.join(str(gpu.index) for gpu in idle)} would offer no device: {first.product_name} cannot "
            f"offer {', '.join(sorted(sharing.offered(first.index))) or 'nothing'}, only {_offerable(first, sharing)}; "
            "change --offer or --sharing-config"
        )


def _check_mig_share_profiles(gpus: list[GpuInfo], sharing: SharingConfig) -> None:
    """A profile no GPU of the node has is a typo: its partitions would silently offer no share."""
    named = set(sharing.mig_share_profiles or ()).union(*sharing.per_gpu_mig_share_profiles.values())
    known = {profile.name for gpu in gpus for profile in gpu.mig_profiles}
    unknown = sorted(named - known)
    if unknown:
        raise SettingsError(
            f"--mig-share-profiles / migShareProfiles name MIG profile(s) {', '.join(unknown)} that no GPU of this "
            f"node has; its GPUs have {', '.join(sorted(known)) or 'no MIG'}"
        )


def _targets(gpu: GpuInfo, offered: frozenset[DeviceKind], sharing: SharingConfig) -> list[DeviceTarget]:
    """Every device the GPU would publish for these kinds: its own, and shares inside its MIG
    partitions (mig-mps, mig-timeslice) for the profiles the config lets share."""
    return gpu_targets(gpu, offered) + mig_share_targets(gpu, offered, sharing)


def _can_offer(gpu: GpuInfo, kind: DeviceKind, sharing: SharingConfig) -> bool:
    return bool(_targets(gpu, frozenset({kind}), sharing))


def _offerable(gpu: GpuInfo, sharing: SharingConfig) -> str:
    return ", ".join(sorted(kind for kind in ALL_KINDS if _can_offer(gpu, kind, sharing)))
