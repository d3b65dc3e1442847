"""Generate the Python protobuf modules and gRPC stubs from the .proto files in this folder, each
beside its users: the kubelet's APIs in driver/node/kubelet/api, the claim-status message in
driver/kube.

The kubelet APIs (dra_*, pluginregistration_*) are upstream's (k8s.io/kubelet v0.37.2) verbatim;
only their file names are flattened. resourceclaim_status.proto is ours: the subset of the
ResourceClaim's API-server encoding that driver/kube/claim_protobuf.py edits (it says why a subset).
gRPC stubs are made only for files with a service. Run: python proto/generate.py [OUTPUT_DIR]
(with OUTPUT_DIR, everything goes there: tests compare it with the committed stubs).
"""

from __future__ import annotations

import re
import shutil
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

PROTO_DIR = Path(__file__).resolve().parent
DRIVER = PROTO_DIR.parent / "driver"
KUBELET_API = DRIVER / "node" / "kubelet" / "api"
# Where each generated module is committed: the kubelet's APIs unless named here.
HOMES = {"resourceclaim_status": DRIVER / "kube"}


def home(generated: Path) -> Path:
    """The committed folder of a generated module (e.g. dra_v1_pb2_grpc.py -> the kubelet API's)."""
    return HOMES.get(generated.name.split("_pb2")[0], KUBELET_API)


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
    if len(sys.argv) > 1:
        for path in generate(Path(sys.argv[1])):
            print(path)
    else:
        with tempfile.TemporaryDirectory() as scratch:
            for path in generate(Path(scratch)):
                shutil.copyfile(path, home(path) / path.name)
                print(home(path) / path.name)
