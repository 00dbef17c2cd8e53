#!/usr/bin/env bash
# Builds (once) and caches what the Xen interop run boots under QEMU's TCG:
#
#   xen            Debian 12's Xen 4.17, decompressed (QEMU's multiboot loader takes no gzip)
#   vmlinuz        Debian 12's kernel, dom0's and the domU's (PV on both sides)
#   initrd.img     dom0's initramfs (Debian's own, from update-initramfs)
#   dom0.img       dom0's root filesystem: debootstrap + Xen's tools (xl, xenstored)
#   domu.cpio.gz   the domU's whole root, an initramfs: busybox, iperf3, fio, mke2fs, the
#                  front-end modules; its /init runs the checks the interop script names
#
# Everything comes from Debian's packages; nothing is built from source. The cache is
# keyed by the hash of this script, the domU's /init and its initramfs builder, so a change
# to any rebuilds.
#
# usage: scripts/xen-interop/images.sh [CACHE_DIR]
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
cache="${1:-${PVIO_INTEROP_CACHE:-$HOME/.cache/pvio/xen-interop}}"
key="$(cat "$here/images.sh" "$here/domu-init" "$here/domu-initramfs" | sha256sum | cut -c1-16)"
out="$cache/$key"
mirror="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"

if [[ -f "$out/ready" ]]; then
    echo "$out"
    exit 0
fi

need() {
    local missing=()
    for p in "$@"; do
        dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
    done
    if ((${#missing[@]})); then
        DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${missing[@]}" >&2
    fi
}
need debootstrap qemu-system-x86 e2fsprogs cpio gzip xz-utils

mkdir -p "$out"
work="$out/work"
root="$work/root"
rm -rf "$work"
mkdir -p "$work"

echo "debootstrap: dom0's root (several minutes)" >&2
debootstrap --variant=minbase \
    --include=systemd-sysv,udev,kmod,iproute2,iputils-ping,procps,iperf3,fio,e2fsprogs,busybox-static,linux-image-amd64,initramfs-tools,xen-system-amd64,xen-utils-4.17,xen-utils-common \
    bookworm "$root" "$mirror" >&2

# dom0's own settings: root on the first virtio disk, the console on Xen's, no password.
cat >"$root/etc/fstab" <<'EOF'
/dev/vda / ext4 defaults,noatime 0 1
EOF
echo pvio-dom0 >"$root/etc/hostname"
chroot "$root" passwd -d root >/dev/null
# The interop run's own unit: mounts the exchange disk and runs what it holds.
cat >"$root/etc/systemd/system/pvio-interop.service" <<'EOF'
[Unit]
Description=pvio Xen interop run (the exchange disk's run-dom0)
After=xen.service xenstored.service xenconsoled.service systemd-udev-settle.service
Wants=xen.service

[Service]
Type=oneshot
ExecStart=/bin/sh -c 'mkdir -p /x && mount /dev/vdb /x && exec /bin/sh /x/run-dom0 >/dev/hvc0 2>&1'
ExecStopPost=/bin/systemctl poweroff --no-block
StandardOutput=journal+console

[Install]
WantedBy=multi-user.target
EOF
chroot "$root" systemctl enable pvio-interop.service >&2
# Nothing else to wait for at boot: no network configuration, no timers.
for u in systemd-timesyncd.service apt-daily.timer apt-daily-upgrade.timer e2scrub_all.timer fstrim.timer; do
    chroot "$root" systemctl mask "$u" >/dev/null 2>&1 || true
done
# The domU's root: an initramfs from dom0's own binaries and modules.
kver="$(ls "$root/lib/modules" | head -n1)"
"$here/domu-initramfs" "$root" "$kver" "$here/domu-init" "$root/opt/pvio/domu.cpio.gz" >&2
cp "$root/boot/vmlinuz-$kver" "$root/opt/pvio/vmlinuz"

cp "$root/boot/vmlinuz-$kver" "$out/vmlinuz"
cp "$root/boot/initrd.img-$kver" "$out/initrd.img"
gzip -dc "$root"/boot/xen-4.17-amd64.gz >"$out/xen"
echo "mke2fs: dom0.img" >&2
rm -f "$out/dom0.img"
mke2fs -q -t ext4 -L pvio-dom0 -d "$root" "$out/dom0.img" 3G
rm -rf "$work"
echo "$kver" >"$out/ready"
echo "$out"
