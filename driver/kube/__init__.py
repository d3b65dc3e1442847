"""Kubernetes API access: the client, the claim-status protobuf, Events."""
