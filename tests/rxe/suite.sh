#!/usr/bin/env bash
# The soft-RoCE suite, run inside the qemu guest by tests/rxe/run.sh (the
# guest has rxe0 on veth0 and rxe1 on veth1, set up by guest-setup.sh).
# RXE_SUITE_MODE is quick or full, RXE_BIN the test binaries' directory:
#   quick (CI): verbs and conformance on real verbs, the engine's rdma tests
#     (failover by a link going down), SAFETY.md's rdma rows in two
#     processes (-short), and one throughput pair;
#   full (make test-rxe): the same rows at full size, the whole engine
#     suite with rdma devices present, and throughput at 64 KiB and 1 MiB,
#     WRITE and READ.
# Every part is timed; the summary at the end counts tests passed, failed
# and skipped and states the SAFETY rows' outcome. Exit status: 0 only if
# no part failed.
set -uo pipefail
mode=${RXE_SUITE_MODE:-quick}
bin=${RXE_BIN:?RXE_BIN names the directory of the test binaries (make rxe-binaries)}
root=$(cd "$(dirname "$0")/../.." && pwd)
out=${RXE_OUT:?}
summary=$out/summary.txt
: >"$summary"
failed_parts=0
total_pass=0 total_fail=0 total_skip=0

export KVFERRY_TEST_RDMA=1
# Tests on real devices: decode (owner) on rxe0, prefill (initiator) on
# rxe1, so that their traffic crosses the veth pair, where it can be shaped
# and cut.
export KVFERRY_TEST_RDMA_OWNER_DEVICES="=${RXE_DEV0:-rxe0}"
export KVFERRY_TEST_RDMA_INITIATOR_DEVICES="=${RXE_DEV1:-rxe1}"
# guest-setup.sh sets KVFERRY_TEST_RDMA_NETDEVS (the links to shape) and
# KVFERRY_TEST_RDMA_LINK_DOWN/_UP (a veth down, and up with its routes).
export KVFERRY_LOG_LEVEL=warn

now() { date +%s.%N; }
secs() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.0f", b - a }'; }

# part NAME DIR -- CMD...: runs a go test binary in DIR (its package's
# directory, as go test would), logs to $out/NAME.log, counts top-level
# tests, and records the part's result.
part() {
  local name=$1 dir=$2; shift 3
  local log=$out/$name.log t0 rc p f s
  echo "== $name: $*"
  t0=$(now)
  (cd "$dir" && "$@") >"$log" 2>&1
  rc=$?
  # Tests and subtests alike (the conformance suite is one test of many
  # subtests; a test whose subtests all skip counts as skipped there).
  p=$(grep -cE '^ *--- PASS' "$log"); f=$(grep -cE '^ *--- FAIL' "$log"); s=$(grep -cE '^ *--- SKIP' "$log")
  total_pass=$((total_pass + p)); total_fail=$((total_fail + f)); total_skip=$((total_skip + s))
  local verdict=ok
  if [ "$rc" -ne 0 ]; then
    verdict="FAILED (exit $rc)"
    failed_parts=$((failed_parts + 1))
    grep -E '^(--- FAIL|    .*_test.go:[0-9]+:|panic:|FAIL)' "$log" | head -40
  fi
  printf '%-18s %-16s %4d passed %3d failed %3d skipped (tests and subtests) %5ss\n' "$name" "$verdict" "$p" "$f" "$s" "$(secs "$t0" "$(now)")" | tee -a "$summary"
  # Each skip with its reason (the test's last line before its result).
  # Subtests skipped for their parent's reason print none of their own.
  awk '/^ *[A-Za-z_]+\.go:[0-9]+: / { last = $0 } /^ *--- SKIP: / { sub(/^ *[A-Za-z_]+\.go:[0-9]+: /, "", last); if (last == "") last = "as above"; printf "    skipped %s: %s\n", $3, last; last = "" }' "$log" | head -30 >>"$summary"
}

short=-test.short
[ "$mode" = full ] && short=
part verbs "$root/verbs" -- "$bin/verbs.test" -test.v -test.count=1 -test.run 'Devices|BadTransition|Missing|NotA'
part rdma-conformance "$root/engine/transport/rdma" -- "$bin/rdma.test" -test.v -test.count=1 -test.timeout 10m
part engine-rdma "$root/engine" -- "$bin/engine.test" -test.v -test.count=1 -test.run 'RDMA' -test.timeout 10m
part safety-rows "$root/tests/pd" -- "$bin/pd.test" -test.v -test.count=1 -test.run 'RDMA' -test.timeout 15m $short
if [ "$mode" = full ]; then
  # The whole engine suite with rdma devices present: tests that state tcp's
  # properties pin tcp, the rest hold on any transport.
  part engine-all "$root/engine" -- "$bin/engine.test" -test.count=1 -test.v -test.timeout 20m
fi

# SAFETY.md's rows on real verbs.
{
  echo "SAFETY rows on soft-RoCE (two processes; decode on ${RXE_DEV0:-rxe0}, prefill on ${RXE_DEV1:-rxe1}):"
  log=$out/safety-rows.log
  row() { # test name, what it is
    local res
    res=$(grep -E "^--- (PASS|FAIL|SKIP): $1 " "$log" | head -1 | awk '{print $2}')
    local bad
    bad=$(awk -v t="=== RUN   $1" '$0 == t {on=1; next} /^=== RUN/ && on {exit} on && /corrupted bytes/ {print; exit}' "$log" | sed 's/^ *//; s/^[a-z_]*\.go:[0-9]*: *//')
    printf '  %-44s %-5s %s\n' "$2" "${res:-n/a}" "$bad"
  }
  row TestRDMAStressACKOnHeardFindsCorruption "protection off (ACK on heard): must corrupt"
  row TestRDMAStressOwnerFenceIsSafe "owner-side QP fence: 0 corrupted bytes"
  row TestRDMAStressDrainAwareACKIsSafe "drain-aware ACK: 0 corrupted bytes"
  row TestRDMAStressACKOrFenceIsSafe "drained ACK or fence (default): 0 corrupted"
  row TestRDMASIGSTOPPrefillFenceAbortIsSafe "fence, prefill stopped then resumed/killed"
  row TestRDMASIGSTOPPrefillDrainAwareAbortIsNotSafe "drain-aware ACK, prefill stopped: NotSafe"
  row TestRDMAFenceAbortLetsOtherRequestsComplete "fence lets other requests complete"
} | tee -a "$summary"

# Throughput in this boot: perftest against kvferry-bench over the same
# link (initiator on rxe1, target on rxe0), as ratios.
bw() { # perftest tool, size: prints GB/s (1e9 bytes)
  local tool=$1 size=$2 srv port=18515 n=300
  timeout 180 "$tool" -d "${RXE_DEV0:-rxe0}" -x "${RXE_GID0:-1}" -p "$port" -s "$size" -n "$3" -F >/dev/null 2>&1 &
  srv=$!
  # The client connects once the server listens (polled, bounded at 30 s).
  until ss -Hltn "sport = :$port" | grep -q .; do
    if ! kill -0 "$srv" 2>/dev/null || [ $((n -= 1)) -le 0 ]; then printf "n/a"; return; fi
    sleep 0.1
  done
  timeout 120 "$tool" -d "${RXE_DEV1:-rxe1}" -x "${RXE_GID1:-1}" -p "$port" -s "$size" -n "$3" -F "${RXE_ADDR0:-10.77.0.1}" 2>/dev/null |
    awk -v s="$size" '$1 == s && NF >= 5 { printf "%.4f", $4 * 1048576 / 1e9; found=1 } END { if (!found) printf "n/a" }'
  wait "$srv" 2>/dev/null
}
kvbench() { # op, size: prints GB/s
  local op=$1 size=$2 tout tgt seg
  tout=$(mktemp)
  KVFERRY_PROTOCOL=rdma KVFERRY_RDMA_DEVICES="=${RXE_DEV0:-rxe0}" \
    "$bin/kvferry-bench" --mode target --host "${RXE_ADDR0:-10.77.0.1}" --buffer-size $((64 << 20)) >"$tout" 2>&1 &
  tgt=$!
  for _ in $(seq 100); do grep -q "target ready" "$tout" && break; sleep 0.1; done
  seg=$(sed -n 's/.*segment=\([^ ]*\).*/\1/p' "$tout")
  KVFERRY_PROTOCOL=rdma KVFERRY_RDMA_DEVICES="=${RXE_DEV1:-rxe1}" \
    timeout 120 "$bin/kvferry-bench" --mode initiator --segment "$seg" --host "${RXE_ADDR1:-10.77.0.2}" --op "$op" \
    --block-size "$size" --threads 2 --batch-size 8 --buffer-size $((64 << 20)) --duration "$3" >"$tout.i" 2>&1
  local rc=$?
  kill "$tgt" 2>/dev/null; wait "$tgt" 2>/dev/null
  if [ $rc -ne 0 ] || ! grep -q "integrity: ok" "$tout.i"; then
    cat "$tout.i" >&2
    printf "FAILED"
  else
    sed -n 's/.* gbps=\([0-9.]*\).*/\1/p' "$tout.i" | head -1
  fi
  rm -f "$tout" "$tout.i"
}
sizes="1048576"; dur=3; iters=200
[ "$mode" = full ] && { sizes="65536 1048576"; dur=5; iters=500; }
echo "Throughput in this boot (GB/s of 1e9 bytes; software emulation, so only the ratios mean anything):" | tee -a "$summary"
printf '  %-6s %8s %12s %14s %8s\n' op size perftest kvferry-bench ratio | tee -a "$summary"
for op in write read; do
  for size in $sizes; do
    p=$(bw "ib_${op}_bw" "$size" "$iters")
    k=$(kvbench "$op" "$size" "$dur")
    [ "$k" = FAILED ] && failed_parts=$((failed_parts + 1))
    r=$(awk -v k="$k" -v p="$p" 'BEGIN { if (p + 0 > 0 && k + 0 > 0) printf "%.2f", k / p; else print "n/a" }')
    printf '  %-6s %8s %12s %14s %8s\n' "$op" "$size" "$p" "$k" "$r" | tee -a "$summary"
  done
done

echo "soft-RoCE suite ($mode): $total_pass passed, $total_fail failed, $total_skip skipped; parts failed: $failed_parts" | tee -a "$summary"
[ "$failed_parts" -eq 0 ]
