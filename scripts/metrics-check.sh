#!/usr/bin/env bash
# Checks that the metrics endpoint tells the rate the bench measures: a
# kvferry-bench loopback run serves its engines' metrics (--metrics-addr);
# curl scrapes the endpoint twice in the middle of the run; the bytes the
# initiator's kvferry_transfer_bytes_total gained between the scrapes, over
# the time between them, are compared with the bench's own GB/s, as a ratio
# (TOLERANCE, default 5%). Then one metrics-cost run: two loopback pairs
# side by side at 64 KiB, one counting and one not, their GB/s as a ratio
# (and two both counting, the floor of what the measurement tells apart).
#   scripts/metrics-check.sh
#   PROTOCOLS="tcp shm" BLOCKS="65536 1048576" DURATION=12 COST_ROUNDS=5 scripts/metrics-check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
BENCH=${BENCH:-bin/kvferry-bench}
PROTOCOLS=${PROTOCOLS:-"tcp shm"}
BLOCKS=${BLOCKS:-"65536 1048576"}
DURATION=${DURATION:-12}
TOLERANCE=${TOLERANCE:-0.05}
COST_ROUNDS=${COST_ROUNDS:-7}
COST_DURATION=${COST_DURATION:-2}
command -v curl >/dev/null || { echo "metrics-check: curl is missing (make deps installs it)"; exit 2; }

scrape() { # $1 = URL; prints "<unix seconds> <initiator bytes>"
  local t0 t1 body
  t0=$(date +%s.%N)
  body=$(curl -sf --max-time 5 "$1")
  t1=$(date +%s.%N)
  # Only the initiator counts kvferry_transfer_bytes_total; the scrape's
  # time is the middle of the request.
  printf '%s\n' "$body" | awk -v t0="$t0" -v t1="$t1" '
    /^kvferry_transfer_bytes_total[{ ]/ { s += $NF }
    END { printf "%.6f %.0f\n", (t0 + t1) / 2, s }'
}

fail=0
for proto in $PROTOCOLS; do
  for block in $BLOCKS; do
    out=$(mktemp)
    "$BENCH" --mode loopback --protocol "$proto" --op write --block-size "$block" --threads 4 \
      --duration "$DURATION" --metrics-addr 127.0.0.1:0 >"$out" 2>&1 &
    bench=$!
    url=
    for _ in $(seq 200); do
      url=$(sed -n 's/^kvferry-bench: metrics at \(http[^ ]*\) .*/\1/p' "$out")
      [ -n "$url" ] && break
      kill -0 "$bench" 2>/dev/null || break
      sleep 0.1
    done
    [ -n "$url" ] || { cat "$out"; echo "metrics-check: the bench served no metrics"; exit 1; }
    # The middle of the run: 2 s after it started, for DURATION-4 s.
    sleep 2
    read -r ta ba < <(scrape "$url")
    sleep $((DURATION - 4))
    read -r tb bb < <(scrape "$url")
    wait "$bench"
    bench_gbps=$(sed -n 's/^RESULT .* gbps=\([0-9.]*\) .*/\1/p' "$out")
    rm -f "$out"
    python3 - "$proto" "$block" "$ta" "$ba" "$tb" "$bb" "$bench_gbps" "$TOLERANCE" <<'PY' || fail=1
import sys
proto, block, ta, ba, tb, bb, bench, tol = sys.argv[1:]
rate = (float(bb) - float(ba)) / (float(tb) - float(ta)) / 1e9
bench, tol = float(bench), float(tol)
ratio = rate / bench
ok = abs(1 - ratio) <= tol
print(f"metrics-check: protocol={proto} block={block} endpoint_gbps={rate:.3f} bench_gbps={bench:.3f} "
      f"ratio={ratio:.4f} ({'within' if ok else 'OUTSIDE'} {tol:.0%})")
sys.exit(0 if ok else 1)
PY
  done
done
if [ "$COST_ROUNDS" -gt 0 ]; then
  "$BENCH" --mode metrics-cost --protocol tcp --op write --block-size 65536 --threads 4 \
    --duration "$COST_DURATION" --rounds "$COST_ROUNDS" --buffer-size $((64 << 20)) 2>&1 | grep -E '^(round|RESULT mode=metrics-cost)'
fi
exit $fail
