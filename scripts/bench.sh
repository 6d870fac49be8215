#!/usr/bin/env bash
# Compares kvferry-bench loopback with the raw-tcp baseline (and iperf3) in
# one run, as ratios: identical runs on these machines differ by up to 1.6x,
# so only figures from the same run are compared. Each pair runs ROUNDS times,
# alternating, and the medians are compared.
#   scripts/bench.sh                 # 64 KiB, 1 MiB, 4 MiB; write and read; tcp and shm
#   BLOCKS="65536" OPS=write ROUNDS=5 DURATION=3 PROTOCOLS=tcp scripts/bench.sh
# Then one abort-latency run (kvferry-bench --mode abort): Abort call to Safe
# with ABORT_RATE MB/s of WRITEs in flight, p50/p99 also as ratios to a Notify
# round trip of the same run. ABORT_RATE=0 skips it; ABORT_PROCESSES=2 runs
# the initiator as a process of its own (the default with MODE=process).
# Each of PROTOCOLS (tcp, and shm: the same-host transport) gets its rows and
# its abort run. Then, unless SAMEHOST=0, the same-host comparison of two
# processes with one submitting thread (kvferry-bench --mode samehost: shm
# against tcp, and against one core's memcpy) and the 4 KiB WRITE round trip
# (--mode pingpong: tcp, shm and a raw TCP ping-pong).
set -euo pipefail
cd "$(dirname "$0")/.."
BENCH=${BENCH:-bin/kvferry-bench}
BLOCKS=${BLOCKS:-"65536 1048576 4194304"}
OPS=${OPS:-"write read"}
THREADS=${THREADS:-4}
ROUNDS=${ROUNDS:-3}
DURATION=${DURATION:-3}
MODE=${MODE:-loopback}        # loopback, or process: a target process of its own, then initiator runs
SEGMENT=${SEGMENT:-}          # with MODE=initiator: host:port of a target already running
ABORT_RATE=${ABORT_RATE:-1000}        # MB/s of background WRITEs during the abort run; 0: no abort run
ABORT_DURATION=${ABORT_DURATION:-10}
ABORT_PROCESSES=${ABORT_PROCESSES:-$([ "$MODE" = process ] && echo 2 || echo 1)}
PROTOCOLS=${PROTOCOLS:-"tcp shm"}
SAMEHOST=${SAMEHOST:-1}

if [ "$MODE" = process ]; then
  tout=$(mktemp)
  "$BENCH" --mode target --buffer-size $((256 << 20)) >"$tout" 2>&1 &
  target=$!
  trap 'kill $target 2>/dev/null; rm -f "$tout"' EXIT
  for _ in $(seq 50); do grep -q "target ready" "$tout" && break; sleep 0.1; done
  SEGMENT=$(sed -n 's/.*segment=\([^ ]*\).*/\1/p' "$tout")
  [ -n "$SEGMENT" ] || { cat "$tout"; echo "target did not start"; exit 1; }
  MODE=initiator
  echo "target process $target serves segment $SEGMENT"
fi

gbps() { sed -n 's/.* gbps=\([0-9.]*\).*/\1/p'; }
median() { sort -n | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }

iperf_gbps() { # one iperf3 run, $1 = block size; prints GB/s (1e9 bytes)
  command -v iperf3 >/dev/null || { echo "n/a"; return; }
  local port=$((20000 + RANDOM % 20000)) json
  iperf3 -s -1 -p "$port" >/dev/null 2>&1 &
  local srv=$!
  sleep 0.5
  # iperf3 refuses blocks above 1 MiB: larger rows run it with -l 1M.
  local bl=$(( $1 > 1048576 ? 1048576 : $1 ))
  json=$(timeout $((DURATION + 10)) iperf3 -c 127.0.0.1 -p "$port" -l "$bl" -P "$THREADS" -t "$DURATION" -J 2>/dev/null || true)
  kill "$srv" 2>/dev/null || true
  wait "$srv" 2>/dev/null || true
  python3 -c 'import json,sys
try: print("%.3f" % (json.loads(sys.argv[1])["end"]["sum_received"]["bits_per_second"]/8e9))
except Exception: print("n/a")' "$json"
}

printf "%-8s %-6s %-9s %10s %10s %10s %8s\n" protocol op block kvferry raw-tcp iperf3 ratio
for proto in $PROTOCOLS; do
for op in $OPS; do
  for bs in $BLOCKS; do
    k=(); r=()
    for _ in $(seq "$ROUNDS"); do
      args=(--mode "$MODE" --protocol "$proto" --op "$op" --block-size "$bs" --threads "$THREADS" --duration "$DURATION")
      [ -n "$SEGMENT" ] && args+=(--segment "$SEGMENT")
      out=$("$BENCH" "${args[@]}") || { echo "$out"; exit 1; }
      grep -q "integrity: ok" <<<"$out" || { echo "$out"; echo "integrity check missing"; exit 1; }
      k+=("$(gbps <<<"$out")")
      r+=("$("$BENCH" --mode raw-tcp --block-size "$bs" --threads "$THREADS" --duration "$DURATION" | gbps)")
    done
    km=$(printf "%s\n" "${k[@]}" | median); rm_=$(printf "%s\n" "${r[@]}" | median)
    ip=$(iperf_gbps "$bs")
    printf "%-8s %-6s %-9s %10s %10s %10s %8s\n" "$proto" "$op" "$bs" "$km" "$rm_" "$ip" "$(python3 -c "print('%.2fx' % ($km/$rm_))")"
  done
done
done

for proto in $PROTOCOLS; do
if [ "$ABORT_RATE" != 0 ]; then
  args=(--mode abort --protocol "$proto" --rate "$ABORT_RATE" --duration "$ABORT_DURATION")
  [ "$ABORT_PROCESSES" = 2 ] && args+=(--two-process)
  # A run with an abort that is not Safe prints FAIL and exits 1.
  out=$("$BENCH" "${args[@]}") || { echo "$out"; echo "abort run failed"; exit 1; }
  res=$(grep '^RESULT mode=abort' <<<"$out") || { echo "$out"; echo "abort RESULT missing"; exit 1; }
  field() { sed -n "s/.* $1=\([^ ]*\).*/\1/p" <<<"$res"; }
  echo
  echo "abort latency over $proto, call to Safe ($(field processes) process(es), $(field aborts) aborts, all Safe," \
    "$(field bg_mbps) MB/s of WRITEs in flight, target $(field target_mbps)):"
  printf "  %-28s p50 %6s us  p90 %6s us  p99 %6s us  max %6s us\n" abort \
    "$(field abort_p50_us)" "$(field abort_p90_us)" "$(field abort_p99_us)" "$(field abort_max_us)"
  printf "  %-28s p50 %6s us  p99 %6s us\n" "Notify round trip (baseline)" "$(field notify_p50_us)" "$(field notify_p99_us)"
  printf "  %-28s p50 %6s us  p99 %6s us\n" "abort, request id idle" "$(field idle_abort_p50_us)" "$(field idle_abort_p99_us)"
  echo "  abort/Notify ratio: p50 $(field ratio_p50), p99 $(field ratio_p99);" \
    "owner refusals $(field refused), of them in flight $(field refused_in_flight)"
fi
done

if [ "$SAMEHOST" != 0 ]; then
  echo
  echo "same host, two processes, one submitting thread (kvferry-bench --mode samehost):"
  out=$("$BENCH" --mode samehost --duration "$((2 * DURATION * ROUNDS))") || { echo "$out"; echo "samehost run failed"; exit 1; }
  grep -v '^RESULT\|level=' <<<"$out"
  echo
  echo "one 4 KiB WRITE, submit to completion, two processes (kvferry-bench --mode pingpong):"
  out=$("$BENCH" --mode pingpong --block-size 4096 --duration "$((2 * DURATION))") || { echo "$out"; echo "pingpong run failed"; exit 1; }
  grep '^RESULT' <<<"$out" | sed 's/^RESULT mode=pingpong /  /'
fi
