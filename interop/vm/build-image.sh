#!/bin/bash
# Builds the Debian bookworm VM that the Lightpath interop suite boots: a kernel with rdma_rxe
# (SoftRoCE), rdma-core and perftest, a tiny initramfs, an ext4 root image, and the
# interop/c/verbs_peer binary compiled against the guest's own libibverbs.
#
#   interop/vm/build-image.sh            build whatever is missing or out of date
#   interop/vm/build-image.sh --rebuild  throw the cache away and build everything
#   interop/vm/build-image.sh --check    exit 0 if everything is up to date, 1 if not (no changes)
#
# Everything lands in the cache directory, never in the repository:
#   ${LIGHTPATH_VM_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/lightpath/rxe-vm}
# Each stage writes a stamp holding a hash of its inputs; a stage (and everything after it)
# is redone when that hash changes, e.g. when guest-packages.txt or guest/lp-init is edited.
# Missing host tools (debootstrap, qemu, e2fsprogs, ...) are installed with apt-get.
#
# Environment: LIGHTPATH_VM_CACHE, LIGHTPATH_VM_MIRROR (default http://deb.debian.org/debian).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
interop=$(dirname "$here")
cache=${LIGHTPATH_VM_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/lightpath/rxe-vm}
mirror=${LIGHTPATH_VM_MIRROR:-http://deb.debian.org/debian}
suite=bookworm
rootfs=$cache/rootfs
started=$SECONDS

log() { printf '[build-image %3ds] %s\n' $((SECONDS - started)) "$*"; }
die() { printf 'build-image: %s\n' "$*" >&2; exit 1; }

mode=build
case "${1:-}" in
    "") ;;
    --rebuild) mode=rebuild ;;
    --check) mode=check ;;
    -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown argument $1 (see --help)" ;;
esac
[ "$(id -u)" = 0 ] || die "must run as root (debootstrap, chroot)"

# ------------------------------------------------------------------------------ stamps
# A stamp file holds the hash of a stage's inputs. Stage inputs chain: each hash includes the
# previous stage's, so a change early on invalidates everything downstream.
packages() { sed 's/#.*//' "$here/guest-packages.txt" | tr -s ' \t' '\n' | grep -v '^$' | sort -u; }

fresh() { [ "$(cat "$cache/stamp.$1" 2>/dev/null)" = "$2" ]; }
stamp() { echo "$2" > "$cache/stamp.$1"; }

# ------------------------------------------------------------------------------ host tools
install_host_tools() {
    local want=() tool pkg
    for pair in debootstrap:debootstrap mkfs.ext4:e2fsprogs tcpdump:tcpdump cpio:cpio \
        xz:xz-utils ip:iproute2 ss:iproute2 modprobe:kmod flock:util-linux; do
        tool=${pair%%:*} pkg=${pair#*:}
        command -v "$tool" > /dev/null || want+=("$pkg")
    done
    if [ ${#want[@]} -gt 0 ]; then
        log "installing host packages: ${want[*]}"
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${want[@]}" \
            > "$cache/host-apt.log" 2>&1 || { tail -20 "$cache/host-apt.log"; die "apt-get install failed"; }
    fi
    command -v qemu-system-x86_64 > /dev/null && return 0
    log "installing qemu-system-x86"
    if DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-remove --no-install-recommends qemu-system-x86 \
        >> "$cache/host-apt.log" 2>&1; then
        return 0
    fi
    # Some hosts carry qemu-utils from bookworm-backports, which conflicts with bookworm's
    # qemu-system-common. Then take qemu-system-x86 from backports as well, through a private
    # sources list so the system's apt configuration stays untouched.
    log "plain install failed (see $cache/host-apt.log); trying bookworm-backports"
    local apt_dir=$cache/host-apt keyring=/usr/share/keyrings/debian-archive-keyring.gpg
    mkdir -p "$apt_dir/lists/partial"
    {
        echo "deb [signed-by=$keyring] $mirror bookworm main"
        echo "deb [signed-by=$keyring] $mirror bookworm-updates main"
        echo "deb [signed-by=$keyring] $mirror bookworm-backports main"
        echo "deb [signed-by=$keyring] http://deb.debian.org/debian-security bookworm-security main"
    } > "$apt_dir/sources.list"
    local opts=(-o "Dir::Etc::SourceList=$apt_dir/sources.list" -o "Dir::Etc::SourceParts=$apt_dir/none"
        -o "Dir::State::Lists=$apt_dir/lists")
    apt-get "${opts[@]}" update -q >> "$cache/host-apt.log" 2>&1
    DEBIAN_FRONTEND=noninteractive apt-get "${opts[@]}" install -y -q --no-install-recommends \
        -t bookworm-backports qemu-system-x86 >> "$cache/host-apt.log" 2>&1 \
        || { tail -20 "$cache/host-apt.log"; die "cannot install qemu-system-x86"; }
}

# ------------------------------------------------------------------------------ chroot helpers
mounted=()
chroot_enter() {
    local m
    cp /etc/resolv.conf "$rootfs/etc/resolv.conf"
    mkdir -p "$cache/apt-archives/partial"
    for m in proc sys dev dev/pts var/cache/apt/archives; do
        mountpoint -q "$rootfs/$m" && continue
        case $m in
            proc) mount -t proc proc "$rootfs/proc" ;;
            sys) mount -t sysfs sysfs "$rootfs/sys" ;;
            dev) mount --bind /dev "$rootfs/dev" ;;
            dev/pts) mount -t devpts devpts "$rootfs/dev/pts" ;;
            # downloaded .debs survive a rebuild of the root filesystem
            var/cache/apt/archives) mount --bind "$cache/apt-archives" "$rootfs/var/cache/apt/archives" ;;
        esac
        mounted=("$rootfs/$m" "${mounted[@]}")
    done
}
chroot_leave() {
    local m
    for m in "${mounted[@]}"; do umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null || true; done
    mounted=()
}
trap chroot_leave EXIT
in_chroot() {
    chroot "$rootfs" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8 \
        DEBIAN_FRONTEND=noninteractive INITRD=No "$@"
}

# ------------------------------------------------------------------------------ stages
make_debootstrap() {
    log "debootstrap $suite (minbase)"
    mkdir -p "$cache/debootstrap-debs"
    rm -rf "$rootfs"
    debootstrap --variant=minbase --cache-dir="$cache/debootstrap-debs" "$suite" "$rootfs" "$mirror" \
        > "$cache/debootstrap.log" 2>&1 || { tail -20 "$cache/debootstrap.log"; die "debootstrap failed"; }
    # keep the pristine tree so a package list change does not need a new debootstrap
    tar -C "$rootfs" -cf "$cache/minbase.tar" .
}

make_packages() {
    log "installing guest packages: $(packages | tr '\n' ' ')"
    rm -rf "$rootfs"
    mkdir -p "$rootfs"
    tar -C "$rootfs" -xf "$cache/minbase.tar"
    # INITRD=No (see in_chroot) stops the kernel's postinst from building Debian's initramfs;
    # we assemble a much smaller one ourselves. No daemons may start inside the chroot.
    printf '#!/bin/sh\nexit 101\n' > "$rootfs/usr/sbin/policy-rc.d"
    chmod 0755 "$rootfs/usr/sbin/policy-rc.d"
    chroot_enter
    {
        # shellcheck disable=SC2046 # one argument per package name is the point
        in_chroot apt-get update -q &&
            in_chroot apt-get install -y -q --no-install-recommends $(packages)
    } > "$cache/guest-apt.log" 2>&1 || { tail -30 "$cache/guest-apt.log"; die "guest package install failed"; }
    chroot_leave
    rm -f "$rootfs/usr/sbin/policy-rc.d"
    rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/usr/share/doc/* "$rootfs"/usr/share/man/* \
        "$rootfs"/usr/share/locale/* "$rootfs"/var/cache/apt/*.bin
    : > "$rootfs/etc/resolv.conf"
    dpkg-query --admindir="$rootfs/var/lib/dpkg" -W -f '${Package} ${Version}\n' > "$cache/guest-packages.lock"
}

make_kernel() {
    local version offset
    version=$(ls "$rootfs/lib/modules" | sort -V | tail -1)
    [ -n "$version" ] || die "no kernel modules in the root filesystem"
    log "kernel $version"
    cp "$rootfs/boot/vmlinuz-$version" "$cache/vmlinuz"
    echo "$version" > "$cache/kernel-version"
    # Under TCG, decompressing the bzImage costs seconds at every boot. Debian's bzImage
    # carries an xz stream holding the ELF vmlinux, which qemu boots directly (PVH entry).
    offset=$(LC_ALL=C grep -obUaP '\xfd7zXZ\x00' "$cache/vmlinuz" | head -1 | cut -d: -f1 || true)
    rm -f "$cache/vmlinux"
    # (xz stops after the stream; a pipe from tail would then fail with SIGPIPE under pipefail)
    if [ -n "$offset" ] && xz -dc --single-stream < <(tail -c +$((offset + 1)) "$cache/vmlinuz") \
        > "$cache/vmlinux.tmp" 2> /dev/null && [ "$(od -An -tx1 -N4 "$cache/vmlinux.tmp" | tr -d ' ')" = 7f454c46 ]; then
        mv "$cache/vmlinux.tmp" "$cache/vmlinux"
    else
        rm -f "$cache/vmlinux.tmp"
        log "could not extract an ELF vmlinux; run.sh will boot the bzImage"
    fi
}

# The initramfs only has to mount the virtio disk and hand over to /sbin/lp-init: static
# busybox plus the handful of modules for virtio-pci, virtio-blk and ext4, in load order.
make_initrd() {
    local version work mod base
    version=$(cat "$cache/kernel-version")
    log "initramfs for $version"
    work=$cache/initramfs
    rm -rf "$work"
    mkdir -p "$work"/{bin,dev,proc,sys,root,modules}
    cp "$rootfs/bin/busybox" "$work/bin/busybox"
    for applet in sh mount umount insmod switch_root sleep cat echo; do ln -s busybox "$work/bin/$applet"; done
    modprobe -d "$rootfs" -S "$version" --show-depends -a virtio_pci virtio_blk ext4 crc32c_generic \
        | awk '$1 == "insmod" && !seen[$2]++ { print $2 }' > "$work/order.tmp"
    [ -s "$work/order.tmp" ] || die "could not resolve the initramfs modules"
    : > "$work/modules/order"
    while read -r mod; do
        [ -e "$mod" ] || mod=$rootfs$mod
        base=$(basename "$mod")
        case "$base" in
            *.ko) cp "$mod" "$work/modules/$base" ;;
            *.ko.xz) base=${base%.xz}; xz -dc "$mod" > "$work/modules/$base" ;;
            *.ko.zst) base=${base%.zst}; zstd -qdc "$mod" > "$work/modules/$base" ;;
            *) die "unexpected module file $mod" ;;
        esac
        echo "/modules/$base" >> "$work/modules/order"
    done < "$work/order.tmp"
    rm "$work/order.tmp"
    cat > "$work/init" << 'EOF'
#!/bin/sh
mount -t devtmpfs devtmpfs /dev
mount -t proc proc /proc
for m in $(cat /modules/order); do insmod "$m" 2> /dev/null; done
n=0
until mount -t ext4 /dev/vda /root 2> /dev/null; do
    n=$((n + 1))
    if [ $n -gt 200 ]; then echo "initramfs: /dev/vda did not appear"; echo o > /proc/sysrq-trigger; fi
    sleep 0.05
done
umount /proc
mount --move /dev /root/dev
exec switch_root /root /sbin/lp-init
EOF
    chmod 0755 "$work/init"
    (cd "$work" && find . | cpio -o -H newc --quiet | gzip -1) > "$cache/initrd.img"
}

make_image() {
    log "root image"
    install -m 0755 "$here/guest/lp-init" "$rootfs/sbin/lp-init"
    echo lp-vm > "$rootfs/etc/hostname"
    printf '127.0.0.1 localhost lp-vm\n10.78.0.1 lightpath-host\n' > "$rootfs/etc/hosts"
    mkdir -p "$rootfs/shared"
    local kib
    kib=$(du -sk "$rootfs" | cut -f1)
    kib=$((kib + kib / 5 + 65536))
    rm -f "$cache/root.ext4.tmp"
    mkfs.ext4 -q -F -L lp-root -d "$rootfs" "$cache/root.ext4.tmp" "${kib}k" > /dev/null
    mv "$cache/root.ext4.tmp" "$cache/root.ext4"
}

make_peer() {
    log "compiling verbs_peer against the guest's libibverbs"
    mkdir -p "$rootfs/tmp/lp-build" "$cache/bin"
    cp "$interop/c/verbs_peer.c" "$rootfs/tmp/lp-build/"
    in_chroot gcc -std=gnu11 -O2 -g -Wall -Wextra -Werror -o /tmp/lp-build/verbs_peer \
        /tmp/lp-build/verbs_peer.c -libverbs || die "verbs_peer.c does not compile"
    install -m 0755 "$rootfs/tmp/lp-build/verbs_peer" "$cache/bin/verbs_peer"
    rm -rf "$rootfs/tmp/lp-build"
}

# Stage input hashes: the stage's own code (declare -f) plus its data, chained.
h_debootstrap=$( { echo "$suite $mirror"; declare -f make_debootstrap; } | sha256sum | cut -c1-16)
h_packages=$( { echo "$h_debootstrap"; packages; declare -f make_packages in_chroot; } | sha256sum | cut -c1-16)
h_kernel=$( { echo "$h_packages"; declare -f make_kernel; } | sha256sum | cut -c1-16)
h_initrd=$( { echo "$h_kernel"; declare -f make_initrd; } | sha256sum | cut -c1-16)
h_image=$( { echo "$h_initrd"; cat "$here/guest/lp-init"; declare -f make_image; } | sha256sum | cut -c1-16)
h_peer=$( { echo "$h_packages"; cat "$interop/c/verbs_peer.c"; declare -f make_peer; } | sha256sum | cut -c1-16)

if [ "$mode" = check ]; then
    for s in "debootstrap $h_debootstrap" "packages $h_packages" "kernel $h_kernel" \
        "initrd $h_initrd" "image $h_image" "peer $h_peer"; do
        set -- $s
        fresh "$1" "$2" || { echo "out of date: $1"; exit 1; }
    done
    echo "up to date: $cache"
    exit 0
fi

# ------------------------------------------------------------------------------ main
[ "$mode" = rebuild ] && { log "removing $cache"; rm -rf "$cache"; }
mkdir -p "$cache"
exec 7> "$cache/.build.lock"
flock -n 7 || { log "another build holds $cache/.build.lock; waiting"; flock 7; }

install_host_tools
redo=0
run_stage() { # name hash function
    if [ "$redo" = 1 ] || ! fresh "$1" "$2"; then
        rm -f "$cache/stamp.$1"
        "$3"
        stamp "$1" "$2"
        redo=1
    fi
}
run_stage debootstrap "$h_debootstrap" make_debootstrap
run_stage packages "$h_packages" make_packages
run_stage kernel "$h_kernel" make_kernel
run_stage initrd "$h_initrd" make_initrd
run_stage image "$h_image" make_image
# the peer binary lives in the cache, not in the image: a C change needs no new image
redo=0
run_stage peer "$h_peer" make_peer
log "ready: kernel $(cat "$cache/kernel-version"), image $(du -h --apparent-size "$cache/root.ext4" | cut -f1), cache $cache"
