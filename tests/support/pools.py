"""A node's pool as the plugin publishes it, read from the API server."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from testbed.node_plugin import NodePlugin
from testbed.workloads import wait_until


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


@contextlib.contextmanager
def serving(plugin: NodePlugin, resource_api) -> Iterator[NodePlugin]:
    """The plugin on its real node, registered with kubelet and its pool published; removed after."""
    plugin.start_registered()
    try:
        wait_until("the node's pool", lambda: complete_pool(resource_api, plugin.node))
        yield plugin
    finally:
        plugin.remove()
