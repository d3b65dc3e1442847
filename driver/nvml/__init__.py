"""NVML access: the real library through pynvml, or the bundled mock. See session.py."""
