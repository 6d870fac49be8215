#!/usr/bin/env bash
# Installs what a fresh Debian 12 machine lacks to build and test kvferry.
# Idempotent and quiet when everything is present; installs as root.
set -euo pipefail

# python3-venv: `make test-python` installs pytest into a venv where pip may not
# write to the system (PEP 668); `make wheel` keeps its tools in one.
# nftables, iproute2: `make test-netfault` drops packets with nft and shapes lo
# with tc.
# etcd-server: the metadata-store tests and the cluster test start their own
# etcd on free ports (the package's service, where systemd runs it, is not
# used).
apt_pkgs=(libzmq3-dev libibverbs-dev pkg-config cmake ninja-build g++ iperf3 python3 python3-pip python3-venv nftables iproute2 curl etcd-server)
missing=()
for p in "${apt_pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "deps: missing Debian packages: ${missing[*]}; run 'make deps' as root" >&2
    exit 1
  fi
  echo "deps: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

if ! command -v go >/dev/null 2>&1; then
  echo "deps: no Go toolchain on PATH (go.mod asks for Go 1.26; Debian 12's golang package is too old)" >&2
  exit 1
fi
# Go modules (cached after the first run).
go mod download

# go-nvml's cgo prologue wraps functions NVML 13 marks deprecated, and gcc
# warns about each of them whenever the package is compiled. The Makefile
# passes -Wno-deprecated-declarations; go commands run by hand (`go vet
# ./...`, `go test ./...`) get the same default from the Go environment
# file, unless CGO_CFLAGS is set there already (undo: go env -u CGO_CFLAGS).
goenv=$(go env GOENV)
if [ "$goenv" != off ] && ! grep -qs '^CGO_CFLAGS=' "$goenv"; then
  echo "deps: go env -w CGO_CFLAGS='-O2 -g -Wno-deprecated-declarations' (go-nvml's deprecation warnings)"
  go env -w CGO_CFLAGS='-O2 -g -Wno-deprecated-declarations'
fi
