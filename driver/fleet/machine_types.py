"""Machine types: a bundled machine profile and what its GPUs offer, and the devices a node of
that type publishes (the same code path as the node plugin on mock NVML: discovery, offers)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from driver.common.flags import SettingsError
from driver.inventory.devices import Inventory
from driver.inventory.fresh_machine import fresh_gpus
from driver.inventory.offers import check_offers, node_inventory
from driver.inventory.sharing import SharingConfigError, load_sharing_config, parse_kinds
from driver.nvml.machine import MachineProfileError, bundled_machines, load_machine

MACHINE_LABEL = "gpu.fgpu.dev/machine"  # on a Node: its bundled machine profile
OFFER_ANNOTATION = "gpu.fgpu.dev/offer"  # on a Node: its GPUs' kinds, as the plugin's --offer
MAX_OFFER_LENGTH = 200  # the longest meaningful --offer is 40 characters


class MachineTypeError(ValueError):
    """A node whose machine type cannot be read, with the field that says why."""


@dataclass(frozen=True)
class MachineType:
    machine: str  # a bundled machine profile (driver/nvml/machines)
    offer: str  # the kinds each GPU offers, as the plugin's --offer


def machine_type_of(node: dict[str, Any], default_offer: str) -> MachineType | None:
    """The node's machine type from its label and annotation; None for a node without the label.
    Only bundled profiles: a node's labels must not name files on this host."""
    metadata = node.get("metadata") or {}
    machine = (metadata.get("labels") or {}).get(MACHINE_LABEL)
    if machine is None:
        return None
    if machine not in bundled_machines():
        raise MachineTypeError(
            f"label {MACHINE_LABEL}={machine!r}: not a bundled machine ({', '.join(bundled_machines())})"
        )
    offer = (metadata.get("annotations") or {}).get(OFFER_ANNOTATION, default_offer)
    if not isinstance(offer, str) or len(offer) > MAX_OFFER_LENGTH:
        raise MachineTypeError(
            f"annotation {OFFER_ANNOTATION}: a comma list of kinds of at most {MAX_OFFER_LENGTH} characters"
        )
    try:
        kinds = parse_kinds(offer, f"annotation {OFFER_ANNOTATION}")
    except SharingConfigError as err:
        raise MachineTypeError(str(err)) from err
    return MachineType(machine, ",".join(sorted(kinds)))


@functools.lru_cache(maxsize=64)
def machine_inventory(machine_type: MachineType) -> Inventory:
    """The devices every node of this type publishes: its GPUs as the node starts, through the
    plugin's discovery and offers."""
    try:
        sharing = load_sharing_config(machine_type.offer, None)
        gpus = fresh_gpus(load_machine(machine_type.machine))
    except (SharingConfigError, MachineProfileError) as err:
        raise MachineTypeError(f"{machine_type.machine} offering {machine_type.offer}: {err}") from err
    try:
        check_offers(gpus, sharing)
    except SettingsError as err:  # a kind this machine's GPUs cannot offer
        raise MachineTypeError(f"annotation {OFFER_ANNOTATION}: {err}") from err
    return node_inventory(gpus, sharing)
