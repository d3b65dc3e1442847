"""The workload operators (JobSet, LeaderWorkerSet, Kubeflow Trainer, KubeRay) for the framework
modules in this folder: each starts once, when a test first asks for it, and stops after the
folder's last test (starting them again for each module took about 3 minutes of a run)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from testbed.cluster.operators import JOBSET, KUBERAY, LWS, TRAINER, HostOperator, OperatorSpec


def _operator(cluster, spec: OperatorSpec, tmp_path_factory: pytest.TempPathFactory) -> Iterator[HostOperator]:
    """The operator on the host; stop() takes out its CRDs, with every object of theirs the tests
    left, and its webhook configurations."""
    operator = HostOperator(cluster, spec, tmp_path_factory.mktemp(spec.name)).start()
    try:
        yield operator
    finally:
        operator.stop()


@pytest.fixture(scope="package")
def jobset_operator(cluster, tmp_path_factory) -> Iterator[HostOperator]:
    yield from _operator(cluster, JOBSET, tmp_path_factory)


@pytest.fixture(scope="package")
def lws_operator(cluster, tmp_path_factory) -> Iterator[HostOperator]:
    yield from _operator(cluster, LWS, tmp_path_factory)


@pytest.fixture(scope="package")
def trainer_operator(cluster, jobset_operator, tmp_path_factory) -> Iterator[HostOperator]:
    """Trainer v2 runs TrainJobs as JobSets: JobSet's operator runs first and stops after it."""
    yield from _operator(cluster, TRAINER, tmp_path_factory)


@pytest.fixture(scope="package")
def kuberay_operator(cluster, tmp_path_factory) -> Iterator[HostOperator]:
    yield from _operator(cluster, KUBERAY, tmp_path_factory)
