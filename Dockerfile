# fgpu node plugin image. The NVIDIA driver (libnvidia-ml) comes from the host through the driver
# root mount; the image carries only Python and fgpu.
FROM python:3.11-slim
WORKDIR /src
COPY pyproject.toml README.md ./
COPY driver ./driver
COPY partitioner ./partitioner
RUN pip install --no-cache-dir . && rm -rf /src
ENV LD_LIBRARY_PATH=/driver-root/usr/lib/x86_64-linux-gnu:/driver-root/usr/lib64
ENTRYPOINT ["fgpu"]
CMD ["kubelet-plugin"]
