# fgpu developer entry points. Prerequisites: Python 3.11, Go 1.26, openssl, make.
VENV ?= .venv
PYTHON := $(VENV)/bin/python
NVML ?= mock:dgx-h100

.PHONY: setup run test unit fuzz cluster cluster-up cluster-down bench lint protos render

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip
	$(VENV)/bin/pip install --quiet -e '.[dev]'
	touch $@

setup: $(VENV)/.installed

# The control plane (kube-apiserver, kube-controller-manager, kube-scheduler, etcd) from upstream
# Go modules, cached in ~/.cache/fgpu/k8s-<version>/.
cluster:
	testbed/cluster/build.sh

# The main job: a local cluster (the real control plane, a real kubelet and containerd) with the
# fgpu plugin on mock GPUs (NVML=real for real ones); runs example pods, prints what their
# containers see, then serves until Ctrl-C. Needs root.
run: setup cluster
	$(PYTHON) -m examples.local_node --nvml $(NVML)

# CI (.ci/run) runs this target, so a lint failure fails CI. The tiers that never wait on the host
# (the pure tests and the differential test) run on every core first; the rest run one at a time.
test: setup cluster lint
	$(PYTHON) -m pytest -q -p no:cacheprovider -n auto tests/unit tests/allocator
	$(PYTHON) -m pytest -q tests --ignore=tests/unit --ignore=tests/allocator

# The quick tier: tests/unit, the pure tests (no root, no Go, no network); the folder is the tier
# (docs/testing.md).
unit: setup
	$(PYTHON) -m pytest -q -p no:cacheprovider -n auto tests/unit

# The differential test on new random scenarios for FUZZ_MINUTES; a failure is written, shrunk,
# to tests/allocator/cases/ (CI runs a fixed set and those cases).
FUZZ_MINUTES ?= 30
fuzz: setup cluster
	$(PYTHON) -m tests.allocator.fuzz --minutes $(FUZZ_MINUTES)

cluster-up: setup cluster
	$(PYTHON) -m testbed.cluster.harness up

cluster-down: setup
	$(PYTHON) -m testbed.cluster.harness down

bench: setup cluster
	$(PYTHON) -m bench.prepare_latency --api memory
	$(PYTHON) -m bench.prepare_latency --api cluster
	$(PYTHON) -m bench.allocator throughput --nodes 500 --claims 300
	$(PYTHON) -m bench.allocator packing --nodes 16 --events 1500

# ruff (lint and format), mypy on driver/ ([tool.mypy] in pyproject.toml) and the layering check:
# `$(VENV)/bin/lint-imports` checks the import contracts in pyproject.toml's [tool.importlinter]
# (driver's packages in layers, partitioner's imports, no package cycle).
lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

# daemonset/*.yaml from the Helm chart, for users without Helm (a test checks they match).
render: setup cluster
	HELM=$$(testbed/cluster/build.sh)/helm daemonset/render.sh

protos: setup
	$(PYTHON) proto/generate.py
