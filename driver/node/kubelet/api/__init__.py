"""Generated kubelet gRPC stubs (proto/generate.py): DRA, health, plugin registration."""
