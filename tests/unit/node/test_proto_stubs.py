import filecmp
import importlib.util
from pathlib import Path

from driver.node.kubelet.api import dra_health_v1_pb2, dra_v1_pb2, dra_v1beta1_pb2, pluginregistration_v1_pb2

ROOT = Path(__file__).resolve().parents[3]


def test_committed_stubs_match_the_protos(tmp_path: Path):
    spec = importlib.util.spec_from_file_location("generate", ROOT / "proto" / "generate.py")
    generate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generate)
    fresh = generate.generate(tmp_path)
    for path in fresh:
        committed = generate.home(path) / path.name
        assert filecmp.cmp(path, committed, shallow=False), f"{path.name} is stale: run proto/generate.py"


def test_wire_names_and_field_numbers():
    service = dra_v1_pb2.DESCRIPTOR.services_by_name["DRAPlugin"]
    assert service.full_name == "k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin"
    assert dra_v1beta1_pb2.DESCRIPTOR.package == "k8s.io.kubelet.pkg.apis.dra.v1beta1"
    device = dra_v1_pb2.Device.DESCRIPTOR.fields_by_name
    assert {n: f.number for n, f in device.items()} == {
        "request_names": 1,
        "pool_name": 2,
        "device_name": 3,
        "cdi_device_ids": 4,
        "share_id": 5,
    }
    assert "share_id" not in dra_v1beta1_pb2.Device.DESCRIPTOR.fields_by_name
    assert pluginregistration_v1_pb2.DESCRIPTOR.package == "pluginregistration"
    info = pluginregistration_v1_pb2.PluginInfo.DESCRIPTOR.fields_by_name
    assert info["supported_versions"].number == 4
    assert dra_health_v1_pb2.DESCRIPTOR.services_by_name["DRAResourceHealth"].full_name == "v1.DRAResourceHealth"
