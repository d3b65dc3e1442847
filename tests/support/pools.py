"""A node's pool as the plugin publishes it, read from the API server."""

from __future__ import annotations


def node_slices(resource_api, node: str) -> list:
    return resource_api.list_resource_slice(field_selector=f"spec.nodeName={node},spec.driver=gpu.fgpu.dev").items


def complete_pool(resource_api, node: str) -> list:
    """The node's slices once all of the pool's newest generation are there, else []."""
    slices = node_slices(resource_api, node)
    if not slices:
        return []
    newest = max(s.spec.pool.generation for s in slices)
    current = [s for s in slices if s.spec.pool.generation == newest]
    return current if len(current) == current[0].spec.pool.resource_slice_count else []
