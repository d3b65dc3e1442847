#!/usr/bin/env bash
# Builds the test control plane (kube-apiserver, kube-controller-manager, kube-scheduler from
# k8s.io/kubernetes, etcd from go.etcd.io/etcd/server/v3/embed) and our Go tools (the reference
# allocator CLI) into a cache outside the tree, and prints that directory. Stamps of the inputs
# make a second build free: the Kubernetes binaries depend on go.mod/go.sum only, our tools also
# on their sources.
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
  for target in kube-apiserver kube-controller-manager kube-scheduler; do
    echo "building $target ${version} (several minutes from a cold cache) ..." >&2
    # -p 2 keeps memory in check on small machines.
    go build -p 2 -ldflags "$ldflags" -o "$out/$target" "k8s.io/kubernetes/cmd/$target"
  done
  echo "$k8s_stamp" > "$out/.stamp-k8s"
fi

tools_stamp="$(stamp_of go.mod go.sum $(find cmd -name '*.go' | sort))"
if ! fresh tools "$tools_stamp"; then
  for target in etcd allocate; do
    echo "building $target ..." >&2
    go build -o "$out/$target" "./cmd/$target"
  done
  echo "$tools_stamp" > "$out/.stamp-tools"
fi
echo "$out"
