import time

from driver.inventory.devices import Inventory, PublishedDevice
from driver.node import metrics
from driver.node.publisher import SlicePublisher
from testbed.fakes import InMemoryKubeApi, node_object

DRIVER = "gpu.fgpu.dev"


def devices(count: int) -> Inventory:
    return Inventory(
        devices=[PublishedDevice(name=f"gpu-{i}", capacity={"memory": 2**30}) for i in range(count)], counter_sets=[]
    )


def published(counter: str, **labels: str) -> float | None:
    return metrics.REGISTRY.get_sample_value(f"fgpu_slice_publish_{counter}_total", labels)


def wait_for(condition, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.02)
    raise AssertionError("condition not met in time")


def test_publish_is_stable_and_changes_bump_the_generation():
    api = InMemoryKubeApi()
    api.nodes["n1"] = node_object("n1", uid="node-uid")
    publisher = SlicePublisher(api, DRIVER, "n1", devices(8))
    publisher.reconcile()
    (only,) = api.slices.values()
    assert only["spec"]["pool"] == {"name": "n1", "generation": 1, "resourceSliceCount": 1}
    assert only["metadata"]["ownerReferences"][0]["uid"] == "node-uid"
    version = only["metadata"]["resourceVersion"]
    publisher.reconcile()
    assert next(iter(api.slices.values()))["metadata"]["resourceVersion"] == version  # nothing rewritten
    publisher.set_inventory(devices(300))
    assert sorted(len(s["spec"]["devices"]) for s in api.slices.values()) == [44, 128, 128]
    assert {s["spec"]["pool"]["generation"] for s in api.slices.values()} == {2}
    publisher.set_inventory(devices(3))
    assert len(api.slices) == 1
    assert next(iter(api.slices.values()))["spec"]["pool"]["generation"] == 3
    api.delete_slice(next(iter(api.slices)))
    publisher.reconcile()
    assert next(iter(api.slices.values()))["spec"]["pool"]["generation"] == 4  # never back to 1


def test_deleted_and_edited_slices_come_back():
    api = InMemoryKubeApi()
    api.nodes["n1"] = node_object("n1")
    publisher = SlicePublisher(api, DRIVER, "n1", devices(4), resync_s=30)
    publisher.start()
    try:
        wait_for(lambda: len(api.slices) == 1)
        name = next(iter(api.slices))
        api.delete_slice(name)  # as kubelet does when it starts
        wait_for(lambda: name in api.slices)
        edited = dict(api.slices[name])
        edited["metadata"] = {**edited["metadata"], "annotations": {}}
        api.replace_slice(name, edited)
        wait_for(lambda: api.slices[name]["metadata"]["annotations"] != {})
    finally:
        api.close()
        publisher.stop()


def test_unreachable_api_server_is_retried():
    api = InMemoryKubeApi()
    api.nodes["n1"] = node_object("n1")
    api.unavailable = True
    failures = published("failures", reason="unavailable")
    retries = published("retries")
    publisher = SlicePublisher(api, DRIVER, "n1", devices(2))
    publisher.start()
    try:
        time.sleep(0.3)
        assert not api.slices
        assert published("failures", reason="unavailable") == failures + 1
        api.unavailable = False
        wait_for(lambda: len(api.slices) == 1, timeout=5)
        assert published("retries") == retries + 1  # the attempt that succeeded
    finally:
        api.close()
        publisher.stop()
