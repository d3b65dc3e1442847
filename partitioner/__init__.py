"""Backends that make fractional allocations real on the node: MIG partitions (mig.py), MPS
shares (mps.py) and time-slicing (timeslice.py). System tools run through runner.py."""
