"""The node's GPUs as DRA sees them: discovery, devices, offers, slices (pure but discovery)."""
