#!/usr/bin/env bash
# Builds the test cluster into a cache outside the tree and prints that directory: the control
# plane (kube-apiserver, kube-controller-manager, kube-scheduler from k8s.io/kubernetes, etcd from
# go.etcd.io/etcd/server/v3/embed), the node (kubelet from k8s.io/kubernetes; containerd, its runc
# shim and ctr from their own module in containerd/; runc, the CNI plugins, busybox and iptables
# from Debian packages), helm (its own module in helm/) and our Go tools (the reference allocator
# CLI, a static pause). Stamps of the inputs make a second build free: the upstream binaries depend
# on go.mod/go.sum only, our tools also on their sources.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$here"
version="$(go list -m -f '{{.Version}}' k8s.io/kubernetes)"
out="${FGPU_CLUSTER_BIN:-${XDG_CACHE_HOME:-$HOME/.cache}/fgpu/k8s-${version#v}}"
mkdir -p "$out"
export CGO_ENABLED=0

stamp_of() { cat "$@" | sha256sum | cut -c1-16; }
fresh() { [[ -f "$out/.stamp-$1" && "$(cat "$out/.stamp-$1")" == "$2" ]]; }

k8s_stamp="$(stamp_of go.mod go.sum)"
if ! fresh k8s "$k8s_stamp"; then
  minor="$(echo "$version" | cut -d. -f2)"
  ldflags="-s -w -X k8s.io/component-base/version.gitVersion=${version}"
  ldflags+=" -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=${minor}"
  for target in kube-apiserver kube-controller-manager kube-scheduler kubelet; do
    echo "building $target ${version} (several minutes from a cold cache) ..." >&2
    # -p 2 keeps memory in check on small machines.
    go build -p 2 -ldflags "$ldflags" -o "$out/$target" "k8s.io/kubernetes/cmd/$target"
  done
  echo "$k8s_stamp" > "$out/.stamp-k8s"
fi

containerd_stamp="$(stamp_of containerd/go.mod containerd/go.sum)"
if ! fresh containerd "$containerd_stamp"; then
  for target in containerd containerd-shim-runc-v2 ctr; do
    echo "building $target (a few minutes from a cold cache) ..." >&2
    # containerd's own module, not ours: its dependency versions differ from Kubernetes'.
    (cd containerd && go build -p 2 -tags "no_btrfs no_devmapper no_zfs" -ldflags "-s -w" \
      -o "$out/$target" "github.com/containerd/containerd/v2/cmd/$target")
  done
  echo "$containerd_stamp" > "$out/.stamp-containerd"
fi

# What the node takes from Debian: runc, the CNI plugins (/usr/lib/cni), busybox for the test
# image, iptables for kubelet and the CNI bridge.
packages=(runc containernetworking-plugins busybox-static iptables)
installed() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed"; }
missing=()
for package in "${packages[@]}"; do installed "$package" || missing+=("$package"); done
if ((${#missing[@]})); then
  echo "installing ${missing[*]} ..." >&2
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}") >&2
fi

tools_stamp="$(stamp_of go.mod go.sum $(find cmd -name '*.go' | sort))"
if ! fresh tools "$tools_stamp"; then
  for target in etcd allocate pause; do
    echo "building $target ..." >&2
    go build -o "$out/$target" "./cmd/$target"
  done
  echo "$tools_stamp" > "$out/.stamp-tools"
fi
# helm, for the chart's tests (daemonset/chart): its own module in helm/, since its Kubernetes
# client libraries are not the versions the control plane above is built from.
helm_stamp="$(stamp_of helm/go.mod helm/go.sum)"
if ! fresh helm "$helm_stamp"; then
  helm_version="$(cd helm && go list -m -f '{{.Version}}' helm.sh/helm/v3)"
  echo "building helm ${helm_version} (a few minutes from a cold cache) ..." >&2
  (cd helm && go build -p 2 -ldflags "-s -w -X helm.sh/helm/v3/internal/version.version=${helm_version}" \
    -o "$out/helm" helm.sh/helm/v3/cmd/helm)
  echo "$helm_stamp" > "$out/.stamp-helm"
fi
# Kueue's manager, for the quota tests (tests/e2e/test_kueue.py): its own module in kueue/, since
# its Kubernetes client libraries are not the control plane's versions; its CRDs and webhook
# configurations from the same module, into kueue-config/ (testbed/cluster/kueue_manager.py).
kueue_stamp="$(stamp_of kueue/go.mod kueue/go.sum)"
if ! fresh kueue "$kueue_stamp"; then
  kueue_version="$(cd kueue && go list -m -f '{{.Version}}' sigs.k8s.io/kueue)"
  echo "building kueue ${kueue_version} (several minutes from a cold cache) ..." >&2
  (cd kueue && go build -p 2 -ldflags "-s -w -X sigs.k8s.io/kueue/pkg/version.GitVersion=${kueue_version}" \
    -o "$out/kueue" sigs.k8s.io/kueue/cmd/kueue)
  kueue_source="$(cd kueue && go list -m -f '{{.Dir}}' sigs.k8s.io/kueue)"
  rm -rf "$out/kueue-config" && mkdir -p "$out/kueue-config/crds"
  cp "$kueue_source"/config/components/crd/bases/*.yaml "$out/kueue-config/crds/"
  cp "$kueue_source/config/components/crd/kustomization.yaml" "$out/kueue-config/crd-kustomization.yaml"
  cp "$kueue_source/config/components/webhook/manifests.yaml" "$out/kueue-config/webhooks.yaml"
  echo "$kueue_stamp" > "$out/.stamp-kueue"
fi
# The workload operators issue 39 runs fgpu under (testbed/cluster/operators.py): JobSet, LeaderWorkerSet
# and Kubeflow Trainer v2 from one module of their own in operators/ (the versions Kueue v0.19
# integrates with; their client libraries are not the control plane's), KubeRay from operators/kuberay/
# (it needs an older controller-runtime). Each one's CRDs and, where it has webhooks, its webhook
# manifests with their kustomize patches, into <name>-config/.
operators_stamp="$(stamp_of operators/go.mod operators/go.sum operators/kuberay/go.mod operators/kuberay/go.sum)"
if ! fresh operators "$operators_stamp"; then
  # name, our module directory, main package, its module, its CRD and webhook directories there.
  while read -r name directory package module crds webhook; do
    source_dir="$(cd "$directory" && go list -m -f '{{.Dir}}' "$module")"
    module_version="$(cd "$directory" && go list -m -f '{{.Version}}' "$module")"
    echo "building $name ${module_version} (a few minutes from a cold cache) ..." >&2
    (cd "$directory" && go build -p 2 -ldflags "-s -w -X $module/pkg/version.GitVersion=${module_version}" \
      -o "$out/$name" "$package")
    rm -rf "$out/$name-config" && mkdir -p "$out/$name-config/crds"
    cp "$source_dir/$crds"/*.yaml "$out/$name-config/crds/"
    rm -f "$out/$name-config/crds/kustomization.yaml"
    if [[ "$webhook" != - ]]; then cp -r "$source_dir/$webhook" "$out/$name-config/webhook"; fi
  done <<'OPERATORS'
jobset operators sigs.k8s.io/jobset sigs.k8s.io/jobset config/components/crd/bases config/components/webhook
lws operators sigs.k8s.io/lws/cmd sigs.k8s.io/lws config/crd/bases config/webhook
trainer operators github.com/kubeflow/trainer/v2/cmd/trainer-controller-manager github.com/kubeflow/trainer/v2 manifests/base/crds manifests/base/webhook
kuberay operators/kuberay github.com/ray-project/kuberay/ray-operator github.com/ray-project/kuberay/ray-operator config/crd/bases -
OPERATORS
  echo "$operators_stamp" > "$out/.stamp-operators"
fi
# kwok's controller, for the fleet tests and benchmarks (nodes without a kubelet:
# testbed/cluster/kwok_manager.py): its own module in kwok/, and its stages (what it does to nodes
# and pods, from the same module) into kwok-config/.
kwok_stamp="$(stamp_of kwok/go.mod kwok/go.sum)"
if ! fresh kwok "$kwok_stamp"; then
  kwok_version="$(cd kwok && go list -m -f '{{.Version}}' sigs.k8s.io/kwok)"
  echo "building kwok ${kwok_version} (a few minutes from a cold cache) ..." >&2
  (cd kwok && go build -p 2 -ldflags "-s -w" -o "$out/kwok" sigs.k8s.io/kwok/cmd/kwok)
  kwok_source="$(cd kwok && go list -m -f '{{.Dir}}' sigs.k8s.io/kwok)"
  rm -rf "$out/kwok-config" && mkdir -p "$out/kwok-config"
  for stage in node/fast/node-initialize node/heartbeat-with-lease/node-heartbeat-with-lease \
    pod/fast/pod-ready pod/fast/pod-complete pod/fast/pod-delete; do
    cp "$kwok_source/kustomize/stage/$stage.yaml" "$out/kwok-config/"
  done
  echo "$kwok_stamp" > "$out/.stamp-kwok"
fi
# Karpenter with its kwok cloud provider, for the autoscaling tests (testbed/cluster/karpenter_manager.py):
# our own main in karpenter/ (kwok's provider wrapped to give instance types fgpu's devices), its own
# module; Karpenter's CRDs (NodePool, NodeClaim, NodeOverlay, CapacityBuffer as its kwok chart ships
# them, KWOKNodeClass) into karpenter-config/crds/. Karpenter v1.15.0 needs Go >= 1.26.9: this section
# builds with go1.27.3, the toolchain this project's machines take from the Go module proxy (README).
karpenter_stamp="$(stamp_of karpenter/go.mod karpenter/go.sum karpenter/*.go)"
if ! fresh karpenter "$karpenter_stamp"; then
  karpenter_version="$(cd karpenter && GOTOOLCHAIN=go1.27.3 go list -m -f '{{.Version}}' sigs.k8s.io/karpenter)"
  echo "building karpenter ${karpenter_version} (several minutes from a cold cache) ..." >&2
  (cd karpenter && GOTOOLCHAIN=go1.27.3 go build -p 2 \
    -ldflags "-s -w -X sigs.k8s.io/karpenter/pkg/operator.Version=${karpenter_version}" -o "$out/karpenter" .)
  karpenter_source="$(cd karpenter && GOTOOLCHAIN=go1.27.3 go list -m -f '{{.Dir}}' sigs.k8s.io/karpenter)"
  rm -rf "$out/karpenter-config" && mkdir -p "$out/karpenter-config/crds"
  cp "$karpenter_source"/kwok/charts/crds/*.yaml "$karpenter_source"/kwok/apis/crds/*.yaml "$out/karpenter-config/crds/"
  echo "$karpenter_stamp" > "$out/.stamp-karpenter"
fi
echo "$out"
