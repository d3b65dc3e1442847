"""fgpu: a Kubernetes DRA driver for fractional GPUs."""
