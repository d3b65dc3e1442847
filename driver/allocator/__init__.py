"""The allocator: pure functions from slices, classes and claims to allocation results."""
