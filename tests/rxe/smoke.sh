#!/bin/bash
# A guest script for tests/rxe/boot.sh: checks the soft-RoCE pair with the
# verbs utilities and perftest, then runs the project's rdma conformance
# suite on it when built (on the host, first:
#   go test -c -o build/rxe/rdma.test ./engine/transport/rdma).
# Prints one line per perftest size, "ib_write_bw 65536 <GB/s>", and the
# time of each step. Under emulation everything is ~100x slower than on
# hardware: compare figures within one boot only.
set -euo pipefail
: "${RXE_DEV0:?run me with tests/rxe/boot.sh}" "${RXE_DEV1:?}" "${RXE_ADDR0:?}" "${RXE_GID0:?}" "${RXE_GID1:?}"
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
tmp=$(mktemp -d)
failed=()

step_t=
step() { step_t=$EPOCHREALTIME; echo "=== $*"; }
took() { awk -v a="$step_t" -v b="$EPOCHREALTIME" -v s="$1" 'BEGIN { printf "=== %s took %.1f s\n", s, b - a }'; }

# Wait (up to $2 s) for a TCP listener on port $1 while pid $3 lives.
wait_listen() {
	local n=$(($2 * 10))
	until ss -Hltn "sport = :$1" | grep -q .; do
		kill -0 "$3" 2>/dev/null && ((n-- > 0)) || return 1
		sleep 0.1
	done
}
# server-command -- client-command: both under a bound, the client once the
# server listens on port $1. Output in $tmp/srv and $tmp/cli.
pair() {
	local port=$1 bound=$2 spid
	shift 2
	local srv=() cli=()
	while [[ $1 != -- ]]; do srv+=("$1"); shift; done
	shift
	cli=("$@")
	timeout "$bound" "${srv[@]}" >"$tmp/srv" 2>&1 &
	spid=$!
	if ! wait_listen "$port" 60 "$spid"; then
		wait "$spid" || true
		echo "server did not listen on $port: $(cat "$tmp/srv")"
		return 1
	fi
	if ! timeout "$bound" "${cli[@]}" >"$tmp/cli" 2>&1; then
		kill "$spid" 2>/dev/null || true
		wait "$spid" || true
		echo "client failed: $(cat "$tmp/cli")"
		echo "server: $(cat "$tmp/srv")"
		return 1
	fi
	if ! wait "$spid"; then
		echo "server failed: $(cat "$tmp/srv")"
		return 1
	fi
}

step ibv_devices
ibv_devices
took ibv_devices

step "ibv_rc_pingpong $RXE_DEV0 <- $RXE_DEV1"
if pair 18610 120 ibv_rc_pingpong -d "$RXE_DEV0" -g "$RXE_GID0" -p 18610 -n 100 -s 65536 -- \
	ibv_rc_pingpong -d "$RXE_DEV1" -g "$RXE_GID1" -p 18610 -n 100 -s 65536 "$RXE_ADDR0"; then
	cat "$tmp/cli"
else
	failed+=(ibv_rc_pingpong)
fi
took ibv_rc_pingpong

# perftest: the server on dev0, the client on dev1. Its BW average column
# is in MB/s of 2^20 bytes with two decimals (finer than --report_gbits,
# which rounds these rates to 0.01 Gb/s); printed here in GB/s (10^9
# bytes). The client's output stays in $RXE_OUT/<tool>-<size>.log.
port=18620
for op in write read; do
	for size in 65536 1048576; do
		t=ib_${op}_bw
		step "$t $size"
		port=$((port + 1))
		common=(-s "$size" -n 200 -F -p "$port")
		if pair "$port" 120 "$t" -d "$RXE_DEV0" -x "$RXE_GID0" "${common[@]}" -- \
			"$t" -d "$RXE_DEV1" -x "$RXE_GID1" "${common[@]}" "$RXE_ADDR0"; then
			# The result row starts with the message size; the 4th column is
			# the average.
			cp "$tmp/cli" "${RXE_OUT:-$tmp}/$t-$size.log"
			mbs=$(awk -v s="$size" '$1 == s && NF >= 5 { print $4 }' "$tmp/cli" | tail -n 1)
			if [[ -n $mbs ]]; then
				awk -v t="$t" -v s="$size" -v m="$mbs" 'BEGIN { printf "%s %d %.5f GB/s\n", t, s, m * 1048576 / 1e9 }'
			else
				echo "$t $size: no result row in:"
				cat "$tmp/cli"
				failed+=("$t $size")
			fi
		else
			failed+=("$t $size")
		fi
		took "$t $size"
	done
done

suite=$repo/build/rxe/rdma.test
if [[ -x $suite ]]; then
	step "rdma conformance suite ($suite)"
	log=${RXE_OUT:-$tmp}/rdma.test.log
	# The package directory as cwd, as go test would run it.
	set +e
	(cd "$repo/engine/transport/rdma" && KVFERRY_TEST_RDMA=1 timeout -k 10 1500 "$suite" -test.v -test.count=1 -test.timeout=20m) >"$log" 2>&1
	src=$?
	set -e
	count() { grep -cE -e "$1" "$log" || true; }
	fail=$(count '^ *--- FAIL')
	echo "rdma.test: $(count '^ *--- PASS') passed, $fail failed, $(count '^ *--- SKIP') skipped" \
		"(tests and subtests); TestConformance: $(count '--- PASS: TestConformance/') subtests passed," \
		"$(count '--- FAIL: TestConformance/') failed; status $src; log $log"
	if ((src != 0)); then
		grep -E -- '^ *--- FAIL|^(panic|FAIL|fatal error)|_test\.go:[0-9]+:' "$log" | head -n 60 || true
		((fail > 0)) || tail -n 30 "$log"
		failed+=(rdma.test)
	fi
	took "rdma conformance suite"
else
	echo "=== rdma conformance suite: $suite not built, skipped"
fi

# Packets the receive backlog dropped: each costs rxe a retry.
drops=0
while read -r _ d _; do drops=$((drops + 16#$d)); done </proc/net/softnet_stat
echo "softnet drops: $drops"

rm -rf "$tmp"
if ((${#failed[@]})); then
	echo "smoke: FAILED: ${failed[*]}"
	exit 1
fi
echo "smoke: all passed"
