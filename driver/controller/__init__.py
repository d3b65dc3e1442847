"""`fgpu controller`: allocates the ResourceClaims that opt in, with the allocator in driver/allocator."""
