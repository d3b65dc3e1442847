"""core/v1 Events, as `kubectl describe` shows them under an object: what the controller and the
node plugin tell users about their pods, claims and gangs."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

JsonObject = dict[str, Any]
MESSAGE_LIMIT = 1024  # the API server refuses longer Event messages


def object_event(
    api_version: str,
    kind: str,
    metadata: JsonObject,
    reason: str,
    message: str,
    component: str,
    now: datetime,
    warning: bool = True,
) -> JsonObject:
    """An Event about the object whose `metadata` (name, namespace, uid, resourceVersion) is given."""
    stamp = now.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {
        "metadata": {"generateName": f"{metadata['name']}.", "namespace": metadata["namespace"]},
        "involvedObject": {
            "apiVersion": api_version,
            "kind": kind,
            "name": metadata["name"],
            "namespace": metadata["namespace"],
            "uid": metadata.get("uid"),
            "resourceVersion": metadata.get("resourceVersion"),
        },
        "reason": reason,
        "message": message[:MESSAGE_LIMIT],
        "type": "Warning" if warning else "Normal",
        "source": {"component": component},
        "reportingComponent": component,
        "firstTimestamp": stamp,
        "lastTimestamp": stamp,
        "count": 1,
    }
