"""The usage history in the cluster (driver/sizing/store.py): each node's ConfigMap, gzipped JSON
under binaryData, and the readers' merge of them."""

from __future__ import annotations

import pytest

from driver.sizing import store
from driver.sizing.history import ClaimRecord, HistoryError, Sample, UsageHistory, Workload, record
from driver.sizing.sizes import Size

H100 = "NVIDIA H100 80GB HBM3"


def one_claim(uid: str, memory_mib: int, at: float = 7200.0) -> UsageHistory:
    claim = ClaimRecord(uid, "team", f"c-{uid}", Workload("Deployment", "web"), "share", "gpu", 0, H100,
                        Size("mps", 10240, 25))  # fmt: skip
    return record(UsageHistory(), [claim], [Sample(uid, at, memory_mib, 5.0)])


def test_a_history_goes_gzipped_under_binary_data_and_comes_back():
    history = one_claim("a", 2048)
    body = store.configmap("node-1", "fgpu-system", history)
    assert body["metadata"] == {
        "name": "fgpu-usage-node-1",
        "namespace": "fgpu-system",
        "labels": {"app.kubernetes.io/component": "usage-history"},
    }
    assert list(body["binaryData"]) == ["history.json.gz"] and "data" not in body
    assert store.history_of(body) == history
    assert store.history_of({"metadata": {"name": "fgpu-usage-x"}}) is None


def test_readers_merge_every_nodes_configmap_and_skip_others():
    maps = [store.configmap(f"node-{i}", "fgpu-system", one_claim(uid, mib)) for i, (uid, mib) in
            enumerate((("a", 2048), ("b", 4096)))]  # fmt: skip
    other = {"metadata": {"name": "fgpu-ledger-x"}, "binaryData": {"history.json.gz": "garbage"}}
    merged = store.merged([*maps, other])
    assert {uid: c.buckets[0].memory_peak_mib for uid, c in merged.claims.items()} == {"a": 2048, "b": 4096}
    assert store.merged([]) == UsageHistory()


def test_a_configmap_that_cannot_be_read_is_named():
    bad = {"metadata": {"name": "fgpu-usage-node-9"}, "binaryData": {"history.json.gz": "bm90IGd6aXA="}}
    with pytest.raises(HistoryError, match="ConfigMap fgpu-usage-node-9: usage history: not gzipped"):
        store.merged([bad])


def test_a_long_node_name_still_makes_a_configmap_name():
    name = store.configmap_name("n" * 250)
    assert len(name) == 253 and name.startswith("fgpu-usage-")
