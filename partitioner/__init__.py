"""Backends that make fractional allocations real on the node: MIG, MPS, time-slicing.

Whole GPUs need no partitioning; the MIG, MPS and time-slicing backends arrive with the
fractional-GPU work (see the issues)."""
