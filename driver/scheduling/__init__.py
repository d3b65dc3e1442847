"""Pure scheduling rules above the allocator: what fits a node, which claims opt in."""
