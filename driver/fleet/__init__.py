"""Slices for nodes that run no node plugin (kwok's simulated nodes, capacity planning): for each
node of a machine type, what fgpu's plugin on that machine publishes."""
