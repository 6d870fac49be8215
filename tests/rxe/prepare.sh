#!/bin/bash
# Prepares what tests/rxe/boot.sh needs, under build/rxe/: Debian's own
# kernel (the one linux-image-amd64 depends on, never installed into the
# host's /boot) with its modules, and a busybox initramfs that mounts the
# host's root filesystem over virtio-9p. Idempotent: a second run only
# checks and prints one line. Exit 77 means "skip": something is missing
# and cannot be installed here.
set -euo pipefail

start=$(date +%s.%N)
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../.." && pwd)
out=$repo/build/rxe
did=()

elapsed() { awk -v a="$1" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }'; }
skip() { echo "rxe prepare: SKIP: $*" >&2; exit 77; }

# --- host tools -------------------------------------------------------------
# Each need is "package:file-or-command"; a file path is checked as such so
# that a dynamic busybox or a missing provider library is caught too.
needs=(
	qemu-system-x86:qemu-system-x86_64
	busybox-static:/bin/busybox
	rdma-core:/usr/sbin/rdma-ndd
	ibverbs-providers:/etc/libibverbs.d/rxe.driver
	ibverbs-utils:ibv_rc_pingpong
	ibverbs-utils:ibv_devinfo
	perftest:ib_write_bw
	iproute2:rdma
	iproute2:ip
	kmod:modprobe
	kmod:depmod
	gzip:gzip
)
missing_pkgs() {
	local n pkg what list=()
	for n in "${needs[@]}"; do
		pkg=${n%%:*} what=${n#*:}
		if [[ $what == /* ]]; then [[ -e $what ]] && continue; else command -v "$what" >/dev/null 2>&1 && continue; fi
		[[ " ${list[*]-} " == *" $pkg "* ]] || list+=("$pkg")
	done
	# The initramfs runs /bin/busybox before any library is there.
	if [[ -x /bin/busybox ]] && ! LC_ALL=C file -b /bin/busybox 2>/dev/null | grep -q 'static'; then
		command -v file >/dev/null 2>&1 && list+=(busybox-static)
	fi
	echo "${list[*]-}"
}
missing=$(missing_pkgs)
if [[ -n $missing ]]; then
	if [[ $EUID -ne 0 ]] || ! command -v apt-get >/dev/null 2>&1; then
		skip "missing packages: $missing (not root or no apt-get; install them with: apt-get install $missing)"
	fi
	export DEBIAN_FRONTEND=noninteractive
	wanted=$missing
	apt-get update -qq
	# shellcheck disable=SC2086 # a list of package names
	apt-get install -y -qq --no-install-recommends $missing >/dev/null
	missing=$(missing_pkgs)
	[[ -z $missing ]] || skip "still missing after apt-get install: $missing"
	did+=("installed $wanted")
fi
for c in apt-get apt-cache dpkg-deb; do
	command -v "$c" >/dev/null 2>&1 || [[ -s $out/kernel-version ]] ||
		skip "$c not found: the guest kernel comes from Debian's package archive"
done

# --- kernel -----------------------------------------------------------------
# The package name follows linux-image-amd64's dependency, so an ABI bump
# in the archive brings the new kernel; offline, the last one fetched stays.
# apt-cache takes a second; ask it only when the package lists changed
# since the last answer.
pkg=
if [[ -s $out/kernel-version ]] && [[ -z $(find /var/lib/apt/lists -maxdepth 1 -newer "$out/kernel-version" -name '*Packages*' 2>/dev/null | head -n 1) ]]; then
	pkg=linux-image-$(cat "$out/kernel-version")
elif command -v apt-cache >/dev/null 2>&1; then
	pkg=$(apt-cache depends linux-image-amd64 2>/dev/null | awk '$1 == "Depends:" && $2 ~ /^linux-image-[0-9]/ { print $2; exit }')
fi
if [[ -z $pkg ]]; then
	[[ -s $out/kernel-version ]] || skip "cannot find the kernel package linux-image-amd64 depends on (apt-cache depends linux-image-amd64)"
	pkg=linux-image-$(cat "$out/kernel-version")
fi
ver=${pkg#linux-image-}
kdir=$out/kernel
mkdir -p "$out"
if [[ $(cat "$out/kernel-version" 2>/dev/null) != "$ver" || ! -s $kdir/boot/vmlinuz-$ver || ! -s $kdir/lib/modules/$ver/modules.dep ]]; then
	rm -rf "$out/dl" "$kdir" "$kdir.tmp" "$out/kernel-version"
	mkdir -p "$out/dl"
	# apt-get download writes into the current directory; as root it
	# would warn that its _apt sandbox user cannot write there.
	sandbox=()
	[[ $EUID -eq 0 ]] && sandbox=(-o APT::Sandbox::User=root)
	(cd "$out/dl" && apt-get download -qq "${sandbox[@]}" "$pkg") ||
		{ echo "rxe prepare: apt-get download $pkg failed" >&2; exit 1; }
	dpkg-deb -x "$out"/dl/"$pkg"_*.deb "$kdir.tmp"
	depmod -b "$kdir.tmp" "$ver"
	mv "$kdir.tmp" "$kdir"
	rm -rf "$out/dl"
	echo "$ver" >"$out/kernel-version"
	did+=("kernel $ver")
fi
touch "$out/kernel-version"
config=$kdir/boot/config-$ver
[[ -s $config ]] || { echo "rxe prepare: $config missing" >&2; exit 1; }

# Under emulation the kernel takes seconds to unpack itself from vmlinuz.
# A kernel with a PVH entry point boots from its ELF image as it is, so keep
# the unpacked one (boot.sh falls back to vmlinuz without it).
vmlinux=$out/vmlinux-$ver
if [[ ! -s $vmlinux ]] && grep -q '^CONFIG_PVH=y' "$config" && grep -q '^CONFIG_KERNEL_XZ=y' "$config" && command -v xz >/dev/null 2>&1; then
	rm -f "$out"/vmlinux-*
	off=$(LC_ALL=C grep -abo $'\xfd''7zXZ' "$kdir/boot/vmlinuz-$ver" | head -n 1 | cut -d: -f1)
	if [[ -n $off ]] && xz -dc --single-stream <(tail -c +$((off + 1)) "$kdir/boot/vmlinuz-$ver") >"$vmlinux.tmp" 2>/dev/null &&
		[[ $(head -c 4 "$vmlinux.tmp") == $'\x7fELF' ]]; then
		mv "$vmlinux.tmp" "$vmlinux"
		did+=("unpacked vmlinux")
	else
		rm -f "$vmlinux.tmp"
		echo "rxe prepare: could not unpack vmlinux from vmlinuz-$ver; booting the packed kernel (slower)" >&2
	fi
fi

# --- initramfs --------------------------------------------------------------
# Only what mounting the host's root over virtio-9p with an overlay on top
# needs; everything else (rdma_rxe, veth) is loaded later from the host
# root with the host's modprobe. Options built into this kernel need
# nothing; the rest are listed in dependency order by modprobe.
initrd=$out/initramfs.cpio.gz
mods=()
for opt in VIRTIO_PCI NET_9P_VIRTIO 9P_FS OVERLAY_FS; do
	case $(grep -E "^CONFIG_${opt}=" "$config" | cut -d= -f2) in
	y) ;;
	m) mods+=("$opt") ;;
	*) echo "rxe prepare: kernel $ver has no CONFIG_$opt" >&2; exit 1 ;;
	esac
done
declare -A modname=([VIRTIO_PCI]=virtio_pci [NET_9P_VIRTIO]=9pnet_virtio [9P_FS]=9p [OVERLAY_FS]=overlay)
ko=()
for opt in "${mods[@]}"; do
	while read -r verb path _; do
		[[ $verb == insmod && " ${ko[*]-} " != *" $path "* ]] && ko+=("$path")
	done < <(modprobe -d "$kdir" -S "$ver" --show-depends "${modname[$opt]}")
done
stamp="$ver $(cat "$here/init.sh" "$here/prepare.sh" | sha256sum | cut -c1-16) ${ko[*]##*/}"
if [[ ! -s $initrd || $(cat "$out/initramfs.stamp" 2>/dev/null) != "$stamp" ]]; then
	stage=$out/initramfs.d
	rm -rf "$stage"
	mkdir -p "$stage"/{bin,dev,proc,sys,modules,lower,rw,out,newroot}
	cp /bin/busybox "$stage/bin/busybox"
	install -m 0755 "$here/init.sh" "$stage/init"
	: >"$stage/modules/order"
	for p in "${ko[@]}"; do
		# busybox insmod takes plain .ko files only.
		n=$(basename "$p")
		case $p in
		*.ko) cp "$p" "$stage/modules/$n" ;;
		*.ko.xz) xz -dc "$p" >"$stage/modules/${n%.xz}"; n=${n%.xz} ;;
		*.ko.zst) zstd -qdc "$p" >"$stage/modules/${n%.zst}"; n=${n%.zst} ;;
		*.ko.gz) gzip -dc "$p" >"$stage/modules/${n%.gz}"; n=${n%.gz} ;;
		*) echo "rxe prepare: unexpected module file $p" >&2; exit 1 ;;
		esac
		echo "$n" >>"$stage/modules/order"
	done
	# busybox's cpio writes newc archives; -R 0:0 so that a non-root
	# build still gives root-owned files.
	(cd "$stage" && find . | LC_ALL=C sort | /bin/busybox cpio -o -H newc -R 0:0 2>/dev/null) | gzip -6 >"$initrd.tmp"
	mv "$initrd.tmp" "$initrd"
	echo "$stamp" >"$out/initramfs.stamp"
	rm -rf "$stage"
	did+=("initramfs ($(wc -c <"$initrd") bytes, modules: $(printf '%s ' "${ko[@]##*/}"| sed 's/\.ko[^ ]*//g; s/ $//'))")
fi

if ((${#did[@]})); then
	printf 'rxe prepare: %s\n' "${did[@]}"
	echo "rxe prepare: done in $(elapsed "$start") s"
else
	echo "rxe prepare: up to date (kernel $ver), $(elapsed "$start") s"
fi
