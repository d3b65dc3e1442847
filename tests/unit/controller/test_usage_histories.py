"""The usage histories of nodes that are gone, deleted by the leader once nothing in them counts
(driver/controller/usage_histories.py): kept while the node is there, while a bucket is within the
week, while unreadable, and when a plugin wrote it after the sweep read it; looked at once an hour."""

from __future__ import annotations

import datetime
import threading

from driver.controller.clock import WallClock
from driver.controller.usage_histories import SWEEP_EVERY_S, HistorySweeper
from driver.kube.informer import Informer
from driver.sizing import store
from driver.sizing.history import RETENTION_S, ClaimRecord, Sample, UsageHistory, Workload, record
from driver.sizing.sizes import Size
from testbed.controller_api import InMemoryControllerApi

NS = "fgpu-system"


def sampled(at: float) -> UsageHistory:
    claim = ClaimRecord("u1", "team", "c", Workload("Deployment", "web"), "share", "gpu", 0,
                        "NVIDIA H100 80GB HBM3", Size("mps", 10240, 25))  # fmt: skip
    return record(UsageHistory(), [claim], [Sample("u1", at, 2048, 5.0)])


def test_the_history_of_a_gone_node_goes_once_its_week_is_over():
    api = InMemoryControllerApi()
    api.put("nodes", {"metadata": {"name": "live"}})
    nodes = Informer(api, "nodes", threading.Event())
    nodes.relist()
    now = datetime.datetime.now(datetime.UTC).timestamp()
    old, recent = now - RETENTION_S - 7200, now - 3600
    for node, at in (("live", old), ("gone-old", old), ("gone-recent", recent), ("gone-raced", old)):
        api.put("configmaps", store.configmap(node, NS, sampled(at)))
    unreadable = store.configmap("gone-unreadable", NS, sampled(old))
    api.put("configmaps", {**unreadable, "binaryData": {store.DATA_KEY: "not gzip"}})
    api.put("configmaps", {"metadata": {"name": "other", "namespace": NS, "labels": {}}})  # not a history
    ticks = [1000.0]
    sweeper = HistorySweeper(api, NS, nodes, WallClock(), clock=lambda: ticks[0])
    real_delete = api.delete_configmap

    def written_meanwhile(namespace, configmap):  # the plugin of a node of that name wrote it since
        if configmap["metadata"]["name"] == "fgpu-usage-gone-raced":
            api.put("configmaps", store.configmap("gone-raced", NS, sampled(now)))
        real_delete(namespace, configmap)

    api.delete_configmap = written_meanwhile  # type: ignore[method-assign]
    assert sweeper.sweep() == 1
    left = {key.partition("/")[2] for key in api.store["configmaps"]}
    assert left == {"fgpu-usage-live", "fgpu-usage-gone-recent", "fgpu-usage-gone-raced",
                    "fgpu-usage-gone-unreadable", "other"}  # fmt: skip
    # Within the hour nothing is read again; after it, the node gone meanwhile and spent goes.
    del api.store["nodes"]["/live"]
    nodes.relist()
    ticks[0] += SWEEP_EVERY_S - 1
    assert sweeper.sweep() == 0 and f"{NS}/fgpu-usage-live" in api.store["configmaps"]
    ticks[0] += 1
    assert sweeper.sweep() == 1 and f"{NS}/fgpu-usage-live" not in api.store["configmaps"]
