"""`fgpu slice-template`: the ResourceSlices every node of a machine type publishes, as an
autoscaler's template for scaling that node type from zero (driver/inventory/templates.py;
docs/autoscaling.md). It discovers the machine profile's GPUs as a freshly started node of that
type has them, with the mock, and offers them as `fgpu discover` does for the same flags."""

from __future__ import annotations

import argparse
import sys

from driver.common.flags import DEFAULT_DRIVER_NAME, Subcommands
from driver.common.yamlfile import document_text
from driver.inventory.fresh_machine import fresh_gpus
from driver.inventory.offers import check_offers, node_inventory, shortfall
from driver.inventory.templates import FORMATS, RENDERERS, node_type_template
from driver.node.settings import sharing_config, validate_driver_name
from driver.nvml.machine import bundled_machines, load_machine


def add_slice_template_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--machine",
        required=True,
        help=f"a bundled machine profile ({', '.join(bundled_machines())}) or a profile YAML file",
    )
    parser.add_argument("--driver-name", default=DEFAULT_DRIVER_NAME, help="DRA driver name")
    # The node's flags of the same names (driver/node/settings.py), without their environment
    # variables: a template is asked for explicitly, not taken from a plugin's environment.
    parser.add_argument(
        "--offer",
        default="whole,mig,mps,timeslice",
        help="device kinds every GPU offers, as the node plugin's --offer: whole,mig,mps,timeslice "
        "(also mig-mps,mig-timeslice)",
    )
    parser.add_argument(
        "--mig-share-profiles", default="", help="as the node plugin's: MIG profiles whose partitions offer shares"
    )
    parser.add_argument("--sharing-config", help="as the node plugin's: YAML file overriding --offer per GPU")
    parser.add_argument("--feature-gates", default="", help="as the node plugin's: Name=true|false,...")
    parser.add_argument(
        "--mig-mode",
        choices=["off", "on"],
        default="off",
        help="the MIG mode the node type's GPUs start in; it changes the devices only where a switch waits "
        "for a GPU reset (Ampere): off, whole-GPU devices and shares; on, MIG devices",
    )
    parser.add_argument(
        "--format",
        choices=FORMATS,
        default="karpenter",
        help="karpenter: an instance type's DynamicResources (slice templates, attribute bindings); "
        "resourceslices: ResourceSlices without a node (Cluster Autoscaler's TemplateNodeInfo)",
    )
    parser.add_argument("-o", "--output", choices=["yaml", "json"], default="yaml")


def cmd_slice_template(args: argparse.Namespace) -> int:
    validate_driver_name(args.driver_name)
    sharing = sharing_config(args)
    machine = load_machine(args.machine)
    gpus = fresh_gpus(machine, args.mig_mode == "on")
    check_offers(gpus, sharing)
    for reason in filter(None, (shortfall(gpu, sharing) for gpu in gpus)):
        print(reason, file=sys.stderr)  # as `fgpu discover`: stdout stays the document
    template = node_type_template(args.driver_name, machine.name, node_inventory(gpus, sharing))
    document = RENDERERS[args.format](template)
    print(document_text(document, args.output == "json"), end="")
    return 0


def register(commands: Subcommands) -> None:
    parser = commands.add_parser(
        "slice-template",
        help="the ResourceSlices a node type publishes, as an autoscaler's template (docs/autoscaling.md)",
        description="Prints what every node of a machine type publishes for an offer, less what names one node "
        "or one GPU (node name, GPU UUIDs): Karpenter's DynamicResources for an instance type, or "
        "ResourceSlices for Cluster Autoscaler's TemplateNodeInfo.",
    )
    add_slice_template_flags(parser)
    parser.set_defaults(func=cmd_slice_template)
