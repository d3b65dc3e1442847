"""Generate the Python protobuf modules and gRPC stubs in driver/kubeletapi from the .proto files
in this folder.

The kubelet APIs (dra_*, pluginregistration_*) are upstream's (k8s.io/kubelet v0.37.2) verbatim;
only their file names are flattened. resourceclaim_status.proto is ours: the subset of the
ResourceClaim's API-server encoding that driver/claim_protobuf.py edits (it says why a subset).
gRPC stubs are made only for files with a service. Run: python proto/generate.py [OUTPUT_DIR]
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from grpc_tools import protoc

PROTO_DIR = Path(__file__).resolve().parent
DEFAULT_OUTPUT = PROTO_DIR.parent / "driver" / "kubeletapi"


def generate(output: Path) -> list[Path]:
    """Compile every .proto here into `output`, with package-relative imports between stubs."""
    output.mkdir(parents=True, exist_ok=True)
    protos = sorted(PROTO_DIR.glob("*.proto"))
    services = [p for p in protos if re.search(r"^service ", p.read_text(), flags=re.M)]
    for args in (
        [f"--python_out={output}", f"--pyi_out={output}", *map(str, protos)],
        [f"--grpc_python_out={output}", *map(str, services)],
    ):
        if protoc.main(["grpc_tools.protoc", f"-I{PROTO_DIR}", *args]) != 0:
            raise RuntimeError("protoc failed")
    generated = sorted(output.glob("*_pb2*.py*"))
    for path in generated:
        # grpc stubs import their messages as top-level modules; make them package-relative.
        text = re.sub(r"^import (\w+_pb2) as", r"from . import \1 as", path.read_text(), flags=re.M)
        path.write_text(text)
    return generated


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_OUTPUT
    for path in generate(target):
        print(path)
