"""Nodes kept for pods with GPUs: the toleration of their taint, added at pod create (POST /mutate
with --gpu-pods-toleration KEY; docs/allocator.md, "Placement").

Where the platform team taints the nodes only the largest pods fit (`KEY=...:NoSchedule`),
kube-scheduler keeps the pods without GPUs off them; the pods with GPUs need the toleration, and no
admission plugin adds one for pods that ask through resource claims (ExtendedResourceToleration
does it only for extended resources). So a pod one of whose claims asks for fgpu's devices
(driver/claims/classes.py) gets `{key: KEY, operator: Exists, effect: NoSchedule}`, unless a
toleration it has already tolerates that taint. Pure: the pod and its claims in, a JSON patch out.
"""

from __future__ import annotations

import re
from typing import Any

EFFECT = "NoSchedule"
# A taint key is a qualified name: an optional DNS-subdomain prefix and "/", then a name of 63 at most.
_NAME = r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
_LABEL = r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?"
_PREFIX = rf"{_LABEL}(\.{_LABEL})*"
_TAINT_KEY = re.compile(rf"({_PREFIX}/)?{_NAME}")


def taint_key(text: str) -> str:
    """The flag's value, checked as kube-apiserver checks a taint's key; ValueError naming it otherwise."""
    prefix = text.rpartition("/")[0]
    if not _TAINT_KEY.fullmatch(text) or len(prefix) > 253:
        raise ValueError(f"--gpu-pods-toleration {text!r}: not a taint key (an optional DNS prefix and '/', "
                         "then 1-63 letters, digits, '-', '_' or '.')")  # fmt: skip
    return text


def toleration(key: str) -> dict[str, str]:
    return {"key": key, "operator": "Exists", "effect": EFFECT}


def tolerates(pod: dict[str, Any], key: str) -> bool:
    """Whether one of the pod's tolerations tolerates a NoSchedule taint `key` of any value."""
    for entry in (pod.get("spec") or {}).get("tolerations") or ():
        if not isinstance(entry, dict) or entry.get("operator", "Equal") != "Exists":
            continue  # Equal tolerates one value only: the taint's may be another
        if entry.get("key", "") in ("", key) and entry.get("effect", "") in ("", EFFECT):
            return True
    return False


def toleration_patch(pod: dict[str, Any], key: str) -> list[dict[str, Any]]:
    """The JSON patch adding the toleration (none where the pod tolerates the taint already)."""
    if tolerates(pod, key):
        return []
    if (pod.get("spec") or {}).get("tolerations"):
        return [{"op": "add", "path": "/spec/tolerations/-", "value": toleration(key)}]
    return [{"op": "add", "path": "/spec/tolerations", "value": [toleration(key)]}]
