#!/bin/busybox sh
# /init of the rxe guest's initramfs (prepare.sh copies it there), so it is
# busybox sh, not bash: nothing else exists yet. It mounts the host's root
# (virtio-9p, read-only) under an overlay with a tmpfs upper layer, mounts
# the output directory share at its host path, chroots into the result to
# run tests/rxe/guest-setup.sh with the host's bash, then powers off. It
# stays PID 1 throughout, so the guest always powers off whatever the
# scripts do.
set -u

/bin/busybox --install -s /bin
export PATH=/bin

# The kernel opened no console (the archive has no /dev/console node, so
# that a non-root prepare can build it): take it from devtmpfs.
mount -t devtmpfs devtmpfs /dev
exec </dev/console >/dev/console 2>&1

off() {
	sync
	poweroff -f
	sleep 5 # poweroff -f does not return; this only bounds the unexpected
	echo o >/proc/sysrq-trigger
}
die() {
	echo "rxe-init: FAILED: $*"
	if [ -n "${outdir:-}" ] && mountpoint -q "/newroot$outdir" 2>/dev/null; then
		echo "rxe-init: $*" >>"/newroot$outdir/guest.log"
		echo 1 >"/newroot$outdir/rc"
	elif mountpoint -q /out 2>/dev/null; then
		echo "rxe-init: $*" >>/out/guest.log
		echo 1 >/out/rc
	fi
	off
}

mount -t proc proc /proc || die "mount /proc"
mount -t sysfs sysfs /sys || die "mount /sys"
hostname rxe-guest

while read -r m; do
	insmod "/modules/$m" || die "insmod $m"
done </modules/order

# msize: the largest 9p message this kernel's virtio transport takes;
# bigger messages mean fewer round trips for every file the guest reads.
p9="trans=virtio,version=9p2000.L,msize=512000"
mount -t 9p -o "$p9,cache=none" rxeout /out || die "mount the output share (tag rxeout)"
# boot.env (written by boot.sh) names the repository, output directory and
# script by their host paths.
[ -r /out/boot.env ] || die "no boot.env in the output share"
# shellcheck disable=SC1091 # written by boot.sh
. /out/boot.env
: "${repo:?}" "${outdir:?}" "${script:?}"

# The host's root is read-only and its files do not change under a run,
# so the guest may cache it (cache=loose): much faster program start-up.
mount -t 9p -o "$p9,ro,cache=loose" hostroot /lower || die "mount the host root share (tag hostroot)"
mount -t tmpfs -o mode=0755 rw /rw || die "mount the overlay's tmpfs"
mkdir -p /rw/upper /rw/work
mount -t overlay -o lowerdir=/lower,upperdir=/rw/upper,workdir=/rw/work overlay /newroot ||
	die "mount the overlay over the host root"

# The API filesystems, and fresh tmpfs where host state must not leak in
# (/run) or where a tmpfs is required (/dev/shm for POSIX shm). /tmp,
# /var/tmp and /root stay the host's, made writable by the overlay, so a
# clone under /tmp is seen at its own path.
mount -t proc proc /newroot/proc || die "mount /proc in the new root"
mount -t sysfs sysfs /newroot/sys || die "mount /sys in the new root"
mount -t devtmpfs devtmpfs /newroot/dev || die "mount /dev in the new root"
mkdir -p /newroot/dev/pts /newroot/dev/shm
mount -t devpts -o gid=5,mode=0620,ptmxmode=0666 devpts /newroot/dev/pts || die "mount /dev/pts"
mount -t tmpfs -o mode=1777 shm /newroot/dev/shm || die "mount /dev/shm"
mount -t tmpfs -o mode=0755 run /newroot/run || die "mount /run"
mkdir -p /newroot/tmp /newroot/var/tmp /newroot/root
chmod 1777 /newroot/tmp /newroot/var/tmp
mkdir -p "/newroot$outdir"
mount --move /out "/newroot$outdir" || die "move the output share to $outdir"

# Module requests from the kernel (a crypto algorithm rdma_rxe needs, a
# tc qdisc) run the modprobe helper in this root, not the chroot's: pass
# them on to the host's modprobe in the chroot, where guest-setup.sh puts
# this kernel's modules at /lib/modules/<version>.
printf '#!/bin/sh\nexec chroot /newroot /sbin/modprobe "$@"\n' >/bin/rxe-modprobe
chmod 0755 /bin/rxe-modprobe
echo /bin/rxe-modprobe >/proc/sys/kernel/modprobe

chroot /newroot /usr/bin/env -i \
	PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin:/usr/local/go/bin \
	HOME=/root USER=root LOGNAME=root SHELL=/bin/bash TERM=dumb LANG=C.UTF-8 \
	RXE_REPO="$repo" RXE_OUT="$outdir" RXE_SCRIPT="$script" \
	/bin/bash "$repo/tests/rxe/guest-setup.sh"
rc=$?
[ -s "/newroot$outdir/rc" ] || echo "$rc" >"/newroot$outdir/rc"
echo "rxe-init: done, rc $(cat "/newroot$outdir/rc")"
off
