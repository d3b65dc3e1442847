# The fgpu image: the node plugin (`fgpu kubelet-plugin`, the default) and the controller
# (`fgpu controller`), one image for both. The NVIDIA driver's libraries come from the host through
# the driver root mount (/driver-root); the image carries Python, fgpu and its dependencies, and
# util-linux's mount and unshare (the MPS daemon's host service runs them).
#
#   docker build -t ghcr.io/fgpu/fgpu:0.1.0 .        (or podman/buildah bud)
#
# BASE_IMAGE: a Debian-based image with python3 >= 3.11 and its venv module. The test bed passes one
# made from Debian packages (testbed/cluster/image_build.py), so it needs no registry.
ARG BASE_IMAGE=docker.io/library/python:3.11-slim-bookworm

# Build stage: fgpu and its pinned dependencies into a virtual environment.
FROM ${BASE_IMAGE} AS build
RUN python3 -m venv /opt/fgpu
COPY pyproject.toml README.md /src/
COPY driver /src/driver
COPY partitioner /src/partitioner
RUN /opt/fgpu/bin/pip install --no-cache-dir --disable-pip-version-check /src \
    && /opt/fgpu/bin/pip uninstall --yes --disable-pip-version-check pip

# Runtime stage: the base and the environment; no pip, no sources, no compilers.
FROM ${BASE_IMAGE}
# The MPS host service needs them on PATH; a base without them fails here, not on a GPU node.
RUN command -v mount && command -v umount && command -v unshare
COPY --from=build /opt/fgpu /opt/fgpu
ENV PATH=/opt/fgpu/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    LD_LIBRARY_PATH=/driver-root/usr/lib/x86_64-linux-gnu:/driver-root/usr/lib64 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
# Root: the plugin needs it (MIG, compute modes, mounts). The controller needs nothing of the kind
# and runs as 65532 through the chart's securityContext.
ENTRYPOINT ["fgpu"]
CMD ["kubelet-plugin"]
