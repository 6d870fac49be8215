#!/usr/bin/env bash
# Runs the soft-RoCE suite (tests/rxe/suite.sh) in a qemu guest on Debian's
# own kernel: `make test-rxe` (full) and, in `make test`, `make test-rxe-ci`
# (quick). Prepares what the guest needs (tests/rxe/prepare.sh), boots it
# (tests/rxe/boot.sh), prints the suite's summary and how long each part
# took. Where qemu cannot run here it says why and exits 0 after writing
# "skipped" to build/rxe/status: a skip is reported as one, never as a pass.
#   tests/rxe/run.sh quick|full
set -uo pipefail
mode=${1:-quick}
case $mode in quick | full) ;; *) echo "usage: $0 quick|full" >&2; exit 2 ;; esac
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
status=build/rxe/status
mkdir -p build/rxe
out=$root/build/rxe/out-$mode
rm -rf "$out"
mkdir -p "$out"
echo "did not finish" >"$status"

now() { date +%s.%N; }
secs() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.0f", b - a }'; }
t0=$(now)

t=$(now)
tests/rxe/prepare.sh
rc=$?
if [ $rc -eq 77 ]; then
  echo "skipped: soft-RoCE guest cannot run here (see above)" >"$status"
  echo "test-rxe: SKIPPED: the soft-RoCE guest cannot run on this machine (see above); rdma ran on the fake provider only"
  exit 0
elif [ $rc -ne 0 ]; then
  echo "failed: prepare" >"$status"
  echo "test-rxe: FAILED: tests/rxe/prepare.sh exited $rc"
  exit 1
fi
prep=$(secs "$t")

# Bounds: the guest's whole run, boot and setup included.
limit=${RXE_TIMEOUT:-$([ "$mode" = full ] && echo 2400 || echo 900)}
t=$(now)
RXE_SUITE_MODE=$mode RXE_BIN=$root/build/rxe/bin tests/rxe/boot.sh "$root/tests/rxe/suite.sh" "$out" "$limit"
rc=$?
guest=$(secs "$t")

echo "---- soft-RoCE suite ($mode) ----"
if [ -s "$out/summary.txt" ]; then
  cat "$out/summary.txt"
else
  echo "(no summary: the suite did not finish; the end of the guest's log follows)"
  tail -40 "$out/guest.log" 2>/dev/null
fi
echo "times: prepare ${prep}s, guest ${guest}s (boot to setup $(cat "$out/boot-seconds" 2>/dev/null || echo ?)s), total $(secs "$t0")s; logs in $out"
case $rc in
  0) echo "passed" >"$status"; echo "test-rxe: passed" ;;
  77) echo "skipped: qemu cannot run here" >"$status"; echo "test-rxe: SKIPPED: qemu cannot run on this machine (see above)"; exit 0 ;;
  124) echo "failed: timeout" >"$status"; echo "test-rxe: FAILED: the guest ran past ${limit}s"; exit 1 ;;
  *) echo "failed: rc $rc" >"$status"; echo "test-rxe: FAILED (exit $rc)"; exit 1 ;;
esac
