"""Where the usage history lives in the cluster (pure): each node plugin's history of the claims it
prepared in a ConfigMap of its own, `fgpu-usage-<node>` in the driver's namespace, as gzipped JSON
under `binaryData` (one writer per object, so plugins never conflict; a week of a node's claims is far
under the 1 MiB object limit: docs/rightsizing.md). Readers merge the nodes' ConfigMaps.
"""

from __future__ import annotations

import base64
import binascii
import gzip
from collections.abc import Iterable
from typing import Any

from driver.sizing.history import HistoryError, UsageHistory, from_json, merge, to_json

NAME_PREFIX = "fgpu-usage-"
DATA_KEY = "history.json.gz"
# What the API server accepts in one object (etcd's request limit is 1.5 MiB; ConfigMaps 1 MiB).
MAX_BYTES = 1024 * 1024
COMPONENT_LABEL = "app.kubernetes.io/component"
COMPONENT = "usage-history"


def configmap_name(node: str) -> str:
    """The node's ConfigMap: ConfigMap names are DNS subdomains of at most 253 characters, as node
    names are; the prefix can take a long node name past that, so the end is cut."""
    return (NAME_PREFIX + node)[:253].rstrip("-.")


def encode(history: UsageHistory) -> str:
    """The history as the base64 text of its gzipped JSON (binaryData's value)."""
    return base64.b64encode(gzip.compress(to_json(history).encode(), mtime=0)).decode()


def decode(data: str) -> UsageHistory:
    try:
        return from_json(gzip.decompress(base64.b64decode(data, validate=True)).decode())
    except (binascii.Error, OSError, EOFError, UnicodeDecodeError) as err:
        raise HistoryError(f"usage history: not gzipped JSON in base64: {err}") from err


def configmap(node: str, namespace: str, history: UsageHistory) -> dict[str, Any]:
    """The ConfigMap body that holds the node's history; HistoryError past the object limit."""
    data = encode(history)
    if len(data) > MAX_BYTES:
        raise HistoryError(f"the usage history of node {node} takes {len(data)} bytes, over {MAX_BYTES}")
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": configmap_name(node),
            "namespace": namespace,
            "labels": {COMPONENT_LABEL: COMPONENT},
        },
        "binaryData": {DATA_KEY: data},
    }


def history_of(obj: dict[str, Any]) -> UsageHistory | None:
    """The history a ConfigMap holds; None where it holds none (not ours, or empty)."""
    data = (obj.get("binaryData") or {}).get(DATA_KEY)
    return decode(data) if data else None


def is_usage_configmap(obj: dict[str, Any]) -> bool:
    return str((obj.get("metadata") or {}).get("name", "")).startswith(NAME_PREFIX)


def merged(configmaps: Iterable[dict[str, Any]]) -> UsageHistory:
    """Every node's history in one (history.merge): what `fgpu rightsize --kubeconfig` reads. A
    ConfigMap that cannot be read is an error that names it."""
    histories: list[UsageHistory] = []
    for obj in configmaps:
        if not is_usage_configmap(obj):
            continue
        try:
            one = history_of(obj)
        except HistoryError as err:
            raise HistoryError(f"ConfigMap {obj['metadata'].get('name')}: {err}") from err
        if one is not None:
            histories.append(one)
    if not histories:
        return UsageHistory()
    result = histories[0]
    for one in histories[1:]:
        result = merge(result, one)
    return result
