"""`fgpu webhook`: refuses bad gpu.fgpu.dev opaque configs at admission, with the rules prepare uses."""
