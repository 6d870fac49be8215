#!/bin/bash
# Usage: tests/rxe/boot.sh SCRIPT OUTDIR [TIMEOUT_SECONDS]
#
# Boots Debian's kernel under qemu (software emulation: the host's /dev/kvm
# cannot boot a stock kernel) on the host's own root filesystem, sets up two
# soft-RoCE devices (tests/rxe/guest-setup.sh) and runs SCRIPT in the guest
# as root with bash, from the repository root. SCRIPT's output goes to
# OUTDIR/guest.log (shown here as it comes), its status to OUTDIR/rc, the
# kernel console to OUTDIR/console.log, the seconds from qemu start to the
# guest's setup and to SCRIPT to OUTDIR/boot-seconds and
# OUTDIR/script-start-seconds. Exits with SCRIPT's status, 124 when
# the timeout (default 1200 s) stopped the guest, 77 when qemu cannot run
# here. KVFERRY_* and RXE_* variables are passed to SCRIPT.
set -euo pipefail

usage() { echo "usage: tests/rxe/boot.sh SCRIPT OUTDIR [TIMEOUT_SECONDS]" >&2; exit 2; }
skip() { echo "rxe boot: SKIP: $*" >&2; exit 77; }
(($# == 2 || $# == 3)) || usage
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../.." && pwd)
b=$repo/build/rxe

script=$(realpath -e "$1" 2>/dev/null) && [[ -f $script && -r $script ]] || { echo "rxe boot: cannot read $1" >&2; exit 2; }
# The guest mounts its own /proc, /sys, /dev and /run over the host's.
case $script in /proc/* | /sys/* | /dev/* | /run/*)
	echo "rxe boot: $script is under a directory the guest does not share; put it elsewhere" >&2; exit 2 ;;
esac
timeout_s=${3:-1200}
if ! [[ $timeout_s =~ ^[0-9]+$ ]] || ((timeout_s == 0)); then usage; fi
mkdir -p "$2"
out=$(realpath "$2")
case $out in /proc/* | /sys/* | /dev/*) echo "rxe boot: OUTDIR $out cannot be shared with the guest" >&2; exit 2 ;; esac

command -v qemu-system-x86_64 >/dev/null 2>&1 || skip "qemu-system-x86_64 not found (tests/rxe/prepare.sh installs it)"
# Cheap when done already; it also rebuilds the initramfs when init.sh
# changed, and exits 77 when the host lacks what it needs.
"$here/prepare.sh" || exit $?
ver=$(cat "$b/kernel-version")
kernel=$b/vmlinux-$ver
[[ -s $kernel ]] || kernel=$b/kernel/boot/vmlinuz-$ver
initrd=$b/initramfs.cpio.gz

now() { date +%s.%N; }
dt() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.1f\n", b - a }'; }

# What the guest reads: boot.env (init.sh, busybox sh: single quotes) and
# env (guest-setup.sh, bash).
rm -f "$out"/{rc,guest.log,console.log,qemu.log,boot.env,env,boot-seconds,script-start-seconds,.rxe-setup,.rxe-script}
: >"$out/guest.log"
sq() { printf "'%s'" "${1//\'/\'\\\'\'}"; }
{
	echo "repo=$(sq "$repo")"
	echo "outdir=$(sq "$out")"
	echo "script=$(sq "$script")"
} >"$out/boot.env"
while read -r v; do
	case $v in KVFERRY_* | RXE_*) printf 'export %s=%q\n' "$v" "${!v}" ;; esac
done < <(compgen -e) >"$out/env"

# qemu option values double their commas.
esc() { printf '%s' "${1//,/,,}"; }
# shellcheck disable=SC2054 # commas inside qemu option values
qemu=(
	qemu-system-x86_64 -accel tcg,thread=multi -cpu max -smp 2 -m 4096 -nographic -no-reboot
	-kernel "$kernel" -initrd "$initrd"
	# panic=-1: a guest that dies reboots, which -no-reboot turns into exit.
	-append "console=ttyS0 panic=-1 mitigations=off ${RXE_CMDLINE:-}"
	-chardev "file,id=con0,path=$(esc "$out/console.log")" -serial chardev:con0 -monitor none
	-nic none
	-virtfs "local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap"
	-virtfs "local,path=$(esc "$out"),mount_tag=rxeout,security_model=none,multidevs=remap"
)
# If this shell is killed outright, the kernel kills qemu with it.
pdeath=()
setpriv --help 2>/dev/null | grep -q -- --pdeathsig && pdeath=(setpriv --pdeathsig KILL)

qpid='' tpid=''
alive() {
	local s
	s=$(cat "/proc/$qpid/stat" 2>/dev/null) || return 1
	s=${s##*) }
	[[ ${s%% *} != Z ]]
}
stop_qemu() {
	[[ -n $qpid ]] || return 0
	if alive; then
		kill -TERM "$qpid" 2>/dev/null || true
		for _ in $(seq 50); do alive || break; sleep 0.1; done
		kill -KILL "$qpid" 2>/dev/null || true
	fi
	# Reap it here: whoever inherits it might not.
	wait "$qpid" 2>/dev/null || true
}
# shellcheck disable=SC2329 # a trap
cleanup() {
	stop_qemu
	[[ -z $tpid ]] || kill "$tpid" 2>/dev/null || true
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
trap 'exit 129' HUP

show_failure() {
	{
		echo "rxe boot: --- last lines of $out/console.log ---"
		tail -n 40 "$out/console.log" 2>/dev/null || true
		if [[ -s $out/qemu.log ]]; then
			echo "rxe boot: --- $out/qemu.log ---"
			tail -n 20 "$out/qemu.log"
		fi
	} >&2
}

t0=$(now)
"${pdeath[@]}" "${qemu[@]}" </dev/null >"$out/qemu.log" 2>&1 &
qpid=$!
tail -n +1 -s 0.5 -f --pid="$qpid" "$out/guest.log" &
tpid=$!

t_setup='' t_script='' timed_out=''
deadline=$((SECONDS + timeout_s))
while alive; do
	[[ -n $t_setup || ! -e $out/.rxe-setup ]] || t_setup=$(now)
	[[ -n $t_script || ! -e $out/.rxe-script ]] || t_script=$(now)
	if ((SECONDS >= deadline)); then
		timed_out=1
		echo "rxe boot: timeout after $timeout_s s: stopping qemu" >&2
		stop_qemu
		break
	fi
	sleep 0.2
done
qrc=0
wait "$qpid" || qrc=$?
t_end=$(now)
wait "$tpid" 2>/dev/null || true
tpid=''

# For callers: seconds from qemu start to the guest's setup, and to SCRIPT.
[[ -z $t_setup ]] || dt "$t0" "$t_setup" >"$out/boot-seconds"
[[ -z $t_script ]] || dt "$t0" "$t_script" >"$out/script-start-seconds"
times="total $(dt "$t0" "$t_end") s"
[[ -z $t_script ]] || times="qemu start to script start $(dt "$t0" "$t_script") s (to setup $(dt "$t0" "$t_setup") s), $times"
[[ -n $t_script || -z $t_setup ]] || times="qemu start to setup $(dt "$t0" "$t_setup") s, $times"
if [[ -n $timed_out ]]; then
	show_failure
	echo "rxe boot: timed out; $times"
	exit 124
fi
if [[ ! -s $out/rc ]]; then
	# qemu that stops before the kernel wrote a line could not run at all.
	if ((qrc != 0)) && [[ ! -s $out/console.log ]]; then
		skip "qemu cannot run here: $(grep -m1 -v '^$' "$out/qemu.log" 2>/dev/null || echo "exit status $qrc")"
	fi
	show_failure
	echo "rxe boot: the guest stopped without writing $out/rc (qemu status $qrc); $times" >&2
	exit 1
fi
rc=$(cat "$out/rc")
[[ $rc =~ ^[0-9]+$ ]] || rc=1
((rc == 0)) || show_failure
echo "rxe boot: guest status $rc; $times"
exit "$rc"
