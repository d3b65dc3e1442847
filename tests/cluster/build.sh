#!/usr/bin/env bash
# Builds the test control plane (kube-apiserver, kube-controller-manager, kube-scheduler from
# k8s.io/kubernetes, etcd from go.etcd.io/etcd/server/v3/embed, and our reference allocator CLI) into a
# cache outside the tree. A stamp of the module files and our sources makes a second build free.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
version="$(cd "$here" && go list -m -f '{{.Version}}' k8s.io/kubernetes)"
out="${FGPU_CLUSTER_BIN:-${XDG_CACHE_HOME:-$HOME/.cache}/fgpu/k8s-${version#v}}"
stamp="$(cat "$here/go.mod" "$here/go.sum" $(find "$here/cmd" -name '*.go' | sort) | sha256sum | cut -c1-16)"

if [[ -f "$out/.stamp" && "$(cat "$out/.stamp")" == "$stamp" ]]; then
  echo "$out"
  exit 0
fi
mkdir -p "$out"
cd "$here"
export CGO_ENABLED=0
# -p 2 keeps memory in check on small machines.
for target in kube-apiserver kube-controller-manager kube-scheduler; do
  echo "building $target ..." >&2
  go build -p 2 -ldflags "-s -w -X k8s.io/component-base/version.gitVersion=${version} -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=$(echo "$version" | cut -d. -f2)" -o "$out/$target" "k8s.io/kubernetes/cmd/$target"
done
for target in etcd allocate; do
  echo "building $target ..." >&2
  go build -o "$out/$target" "./cmd/$target"
done
echo "$stamp" > "$out/.stamp"
echo "$out"
