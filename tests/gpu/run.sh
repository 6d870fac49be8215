#!/usr/bin/env bash
# Runs kvferry's GPU tests on a machine with an NVIDIA GPU and driver
# (libcuda.so.1), from what tests/gpu/build.sh built elsewhere (build/gpu):
# device memory registered (cuda:N and "*" detection), data moved
# GPU->GPU and GPU<->CPU between two processes over tcp through host staging
# and over shm through CUDA IPC (the owner opens the initiator's allocation
# and copies device to device), with every byte checked, and the staging
# throughput of one process printed. Bounded to 3 minutes. Exit status: the tests'.
set -uo pipefail
cd "$(dirname "$0")/../.."
dir=build/gpu
if [ ! -x "$dir/engine.test" ]; then
  echo "tests/gpu/run.sh: $dir/engine.test missing: run tests/gpu/build.sh first (where Go is)" >&2
  exit 2
fi
export LD_LIBRARY_PATH="$PWD/$dir/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export KVFERRY_TEST_GPU=1 KVFERRY_LOG_LEVEL=warn
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=index,name,pci.bus_id,memory.total --format=csv,noheader
out=$(timeout 30 "$dir"/cuda.test -test.v -test.count=1 -test.run '^TestRealDriver$' 2>&1); rc=$?
echo "$out"
[ $rc -eq 0 ] || exit $rc
if grep -q -- '--- SKIP' <<<"$out"; then
  echo "tests/gpu/run.sh: no usable GPU driver here; nothing was tested" >&2
  exit 2
fi
cd engine
timeout 150 ../"$dir"/engine.test -test.v -test.count=1 \
  -test.run '^(TestGPUTransfersOverTCPThroughStaging|TestTwoProcessesGPUOverTCP|TestTwoProcessesGPUOverSHMThroughIPC|TestTwoProcessesGPUToHostMemoryOverSHM)$' 2>&1 |
  grep -v 'level=INFO'
exit "${PIPESTATUS[0]}"
