#!/bin/bash
# Runs inside the rxe guest, chrooted into the overlay over the host's root
# (tests/rxe/init.sh starts it): loads the RDMA modules of the guest kernel,
# builds two soft-RoCE devices on a veth pair, checks the verbs stack end to
# end, then runs the script boot.sh was given. Its output and the script's
# go to $RXE_OUT/guest.log, the script's status to $RXE_OUT/rc; a setup
# failure writes rc 1 and says why in the log.
set -euo pipefail
: "${RXE_REPO:?}" "${RXE_OUT:?}" "${RXE_SCRIPT:?}"

exec >>"$RXE_OUT/guest.log" 2>&1
# boot.sh times the boot by when this marker appears.
: >"$RXE_OUT/.rxe-setup"
t0=$EPOCHREALTIME
since() { awk -v a="$1" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }'; }

fail() {
	echo "rxe-setup: FAILED: $*"
	echo 1 >"$RXE_OUT/rc"
	exit 1
}
trap 'echo "rxe-setup: FAILED at line $LINENO (status $?): $BASH_COMMAND"' ERR
trap 'rc=$?; ((rc == 0)) || [[ -s $RXE_OUT/rc ]] || echo 1 >"$RXE_OUT/rc"' EXIT

# KVFERRY_* and RXE_* variables boot.sh was given.
if [[ -s $RXE_OUT/env ]]; then
	# shellcheck disable=SC1091
	. "$RXE_OUT/env"
fi
# RXE_TRACE=1 traces this script with timestamps.
if [[ -n ${RXE_TRACE:-} ]]; then
	PS4='+ $EPOCHREALTIME '
	set -x
fi

ver=$(uname -r)
kdir=$RXE_REPO/build/rxe/kernel
[[ -d $kdir/lib/modules/$ver ]] || fail "no modules for kernel $ver under $kdir (run tests/rxe/prepare.sh)"
# The kernel's own module requests (a tc qdisc, say) run /sbin/modprobe,
# which looks in /lib/modules/<version>: show it this kernel's modules.
mkdir -p "/lib/modules/$ver"
mount --bind "$kdir/lib/modules/$ver" "/lib/modules/$ver"
# shellcheck disable=SC2086 # RXE_MODULES is a list
modprobe -d "$kdir" -a ib_core ib_uverbs rdma_rxe veth ${RXE_MODULES:-} || fail "modprobe of the rdma modules"

a0=10.77.0.1 a1=10.77.0.2
sysw() { echo "$2" >"/proc/sys/$1"; }
ip link add veth0 type veth peer name veth1
for d in veth0 veth1; do
	# Without IPv6 addresses the GID tables hold only the default link-local
	# GIDs and the IPv4 ones, so nothing can pick a GID routed through lo.
	sysw "net/ipv6/conf/$d/disable_ipv6" 1
	# Both addresses are local, so each end receives packets whose source
	# is one of its own addresses: accept them, and take no reverse-path
	# check against the routes that would send them back through lo.
	sysw "net/ipv4/conf/$d/accept_local" 1
	sysw "net/ipv4/conf/$d/rp_filter" 0
	# ARP: answer only for the address on the interface asked, and ask
	# with the source of the interface sending.
	sysw "net/ipv4/conf/$d/arp_ignore" 1
	sysw "net/ipv4/conf/$d/arp_announce" 2
done
sysw net/ipv4/conf/all/rp_filter 0
# veth hands packets to the receiving CPU's backlog, 1000 packets by
# default: one 1 MiB RDMA READ response is 1024 packets at rxe's MTU, and
# the drops past that leave rxe retrying (or stuck) rather than sending.
sysw net/core/netdev_max_backlog 32768
ip addr add "$a0/24" dev veth0
ip addr add "$a1/24" dev veth1
ip link set lo up
ip link set veth0 up
ip link set veth1 up

# rxe drops what arrives on lo, and the local table would send traffic
# between two local addresses through lo. So locally generated packets
# (iif lo) first look in table 100, which sends each address's traffic out
# of the other end of the pair; the local table comes after it, and still
# delivers what arrives on the veths.
routes() {
	ip route replace "$a1" dev veth0 src "$a0" table 100
	ip route replace "$a0" dev veth1 src "$a1" table 100
}
routes
ip rule add pref 100 iif lo lookup 100
ip rule add pref 200 lookup local
ip rule del pref 0 lookup local

rdma link add rxe0 type rxe netdev veth0
rdma link add rxe1 type rxe netdev veth1

# Bounded waits: a condition, polled every 0.1 s for up to $1 seconds.
waitfor() {
	local n=$(($1 * 10))
	shift
	while ! "$@"; do
		((n-- > 0)) || return 1
		sleep 0.1
	done
}
# shellcheck disable=SC2329 # called through waitfor
active() {
	local s
	read -r s <"/sys/class/infiniband/$1/ports/1/state" 2>/dev/null && [[ $s == *ACTIVE* ]]
}
# The RoCE v2 GID of an IPv4 address: ::ffff:a.b.c.d.
gid_index() {
	local dev=$1 want f i g t
	# shellcheck disable=SC2086 # split the address on its dots
	want=$(printf '0000:0000:0000:0000:0000:ffff:%02x%02x:%02x%02x' ${2//./ })
	for f in /sys/class/infiniband/"$dev"/ports/1/gids/*; do
		i=${f##*/}
		read -r g <"$f" 2>/dev/null && [[ $g == "$want" ]] || continue
		read -r t <"/sys/class/infiniband/$dev/ports/1/gid_attrs/types/$i" 2>/dev/null && [[ $t == "RoCE v2" ]] || continue
		echo "$i"
		return 0
	done
	return 1
}
for d in rxe0 rxe1; do
	waitfor 20 active "$d" || fail "$d port not ACTIVE after 20 s: $(cat "/sys/class/infiniband/$d/ports/1/state" 2>&1)"
done
waitfor 20 gid_index rxe0 "$a0" >/dev/null || fail "no RoCE v2 GID for $a0 on rxe0"
waitfor 20 gid_index rxe1 "$a1" >/dev/null || fail "no RoCE v2 GID for $a1 on rxe1"
g0=$(gid_index rxe0 "$a0") g1=$(gid_index rxe1 "$a1")

devs=$(ibv_devices) || fail "ibv_devices: $devs"
for d in rxe0 rxe1; do
	[[ $devs =~ [[:space:]]${d}[[:space:]] ]] || fail "ibv_devices does not list $d: $devs"
	info=$(ibv_devinfo -d "$d") || fail "ibv_devinfo -d $d: $info"
	[[ $info == *PORT_ACTIVE* ]] || fail "ibv_devinfo -d $d shows no active port: $info"
done

# A listener on a TCP port, polled for up to $2 seconds while pid $3 lives.
listening() { ss -Hltn "sport = :$1" | grep -q .; }
wait_listen() {
	local n=$(($2 * 10))
	until listening "$1"; do
		kill -0 "$3" 2>/dev/null && ((n-- > 0)) || return 1
		sleep 0.1
	done
}
tmp=$(mktemp -d)
timeout 60 ibv_rc_pingpong -d rxe0 -g "$g0" -p 18600 -n 10 >"$tmp/srv" 2>&1 &
spid=$!
wait_listen 18600 30 "$spid" || fail "ibv_rc_pingpong server on rxe0 did not listen: $(cat "$tmp/srv")"
if ! timeout 60 ibv_rc_pingpong -d rxe1 -g "$g1" -p 18600 -n 10 "$a0" >"$tmp/cli" 2>&1; then
	kill "$spid" 2>/dev/null || true
	wait "$spid" || true
	fail "ibv_rc_pingpong rxe1 -> rxe0: $(cat "$tmp/cli"); server: $(cat "$tmp/srv")"
fi
wait "$spid" || fail "ibv_rc_pingpong server on rxe0: $(cat "$tmp/srv")"
rm -rf "$tmp"

# Taking a link down flushes the routes through it; the way back up puts
# them back. Tests that need a failing link use these. With its routes
# gone, traffic between the two local addresses would fall through to the
# local table and go on over loopback, so that the link being down cut
# nothing, depending on when the kernel dropped which route: the way down
# puts blackhole routes in their place, and the way up replaces them.
mkdir -p /run/rxe
# shellcheck disable=SC2016 # $1 is the helper's
{
	printf '#!/bin/sh\nset -e\nip link set "${1:-veth1}" down\n'
	printf 'ip route replace blackhole %s table 100\n' "$a1"
	printf 'ip route replace blackhole %s table 100\n' "$a0"
} >/run/rxe/link-down
# shellcheck disable=SC2016 # $1 is the helper's
{
	printf '#!/bin/sh\nset -e\nip link set "${1:-veth1}" up\n'
	printf 'ip route replace %s dev veth0 src %s table 100\n' "$a1" "$a0"
	printf 'ip route replace %s dev veth1 src %s table 100\n' "$a0" "$a1"
} >/run/rxe/link-up
chmod +x /run/rxe/link-down /run/rxe/link-up

export RXE_DEV0=rxe0 RXE_DEV1=rxe1 RXE_ADDR0=$a0 RXE_ADDR1=$a1 RXE_GID0=$g0 RXE_GID1=$g1
export RXE_NETDEV0=veth0 RXE_NETDEV1=veth1
# The knobs the project's rdma tests read on real devices, unless given.
export KVFERRY_TEST_RDMA_NETDEVS=${KVFERRY_TEST_RDMA_NETDEVS:-veth0 veth1}
export KVFERRY_TEST_RDMA_LINK_DOWN=${KVFERRY_TEST_RDMA_LINK_DOWN:-/run/rxe/link-down}
export KVFERRY_TEST_RDMA_LINK_UP=${KVFERRY_TEST_RDMA_LINK_UP:-/run/rxe/link-up}
echo "rxe-setup: ready in $(since "$t0") s: rxe0 on veth0 $a0 (gid $g0), rxe1 on veth1 $a1 (gid $g1), kernel $ver"

trap - ERR EXIT
set +e
# Registering memory pins it.
ulimit -l unlimited
: >"$RXE_OUT/.rxe-script"
cd "$RXE_REPO"
bash "$RXE_SCRIPT" </dev/null
rc=$?
echo "$rc" >"$RXE_OUT/rc"
exit "$rc"
