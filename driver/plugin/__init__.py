"""The kubelet plugin: registration, DRA and health gRPC services on Unix sockets."""
