"""The local test bed: a control plane and a real node built from upstream (cluster/), the plugin
as a real process driven as kubelet drives it (plugin_process.py), on a real node
(node_plugin.py), claims created allocated (claims_api.py), an in-memory API server stand-in
(fakes.py), workloads that report what their containers see (workloads.py), and the whole
local cluster that `make run` and the benchmarks stand up (local_cluster.py). The tests use it
too; it imports nothing from tests/."""
