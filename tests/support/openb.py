"""Trace pods and a tiny openb trace folder (nodes, a default pod list, the authors' results CSV)
for the openb benches' tests."""

from __future__ import annotations

from pathlib import Path

from bench.openb import TracePod


def write_tiny_traces(folder: Path) -> Path:
    """Three nodes, four pods (a share, a T4-only share, a whole GPU, a CPU-only pod) with their
    recorded times (one never scheduled), and one published BestFit row of 90% allocation at every
    arrived %."""
    (folder / "openb_node_list_gpu_node.csv").write_text(
        "sn,cpu_milli,memory_mib,gpu,model\nn0,8000,65536,2,T4\nn1,8000,65536,8,G2\nn2,8000,65536,2,T4\n"
    )
    (folder / "openb_pod_list_default.csv").write_text(
        "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,creation_time,deletion_time,scheduled_time\n"
        "a,1000,1024,1,600,,0,1000,5\nb,1000,1024,1,400,T4,100,400,\nc,1000,1024,1,1000,,200,900,200\n"
        "d,2000,1024,0,0,,300,350,301\n"
    )
    (folder / "fgd_expected_results").mkdir()
    header = "workload,sc_policy,tune,seed,total_gpus," + ",".join(str(b) for b in range(131))
    row = "openb_pod_list_default,05-BestFit,1.3,42,6212," + ",".join("90" for _ in range(131))
    (folder / "fgd_expected_results" / "analysis_allo_discrete.csv").write_text(f"{header}\n{row}\n")
    return folder


def pod(name: str, gpus: int = 1, milli: int = 1000, cpu: int = 1000, spec: tuple[str, ...] = ()) -> TracePod:
    """A trace pod with 1 GiB of memory; `milli` per GPU (0 for a CPU-only pod)."""
    return TracePod(name, cpu, 1024, gpus, milli if gpus else 0, spec)
