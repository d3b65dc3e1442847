"""What a ResourceClaim means to fgpu, shared by the node plugin, the admission webhook, `fgpu status`
and the controller (pure: claim JSON in, dataclasses out): `refs` (a claim as kubelet names it, and
why it cannot be prepared), `allocation` (the node's share of a claim's allocation), `config` (our
opaque device configs and their strict parser)."""
