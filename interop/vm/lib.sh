# shellcheck shell=bash
# Host-side control of the interop VM, sourced by run.sh and run-suite.sh.
#
# One VM session looks like this:
#
#   lpvm_net_up                 # namespace $LPVM_NETNS with tap $LPVM_TAP = 10.78.0.1/24
#   lpvm_pcap_start FILE        # optional: tcpdump udp/4791 on the tap
#   lpvm_boot                   # qemu; returns once rxe0 is ACTIVE in the guest
#   lpvm_job ID 'shell code' 60 # run code in the guest (waits); lpvm_job_start/_wait split it
#   lpvm_ns CMD...              # run CMD on the host inside the namespace (the Lightpath side)
#   lpvm_stop                   # power off
#   lpvm_cleanup                # (trap EXIT) kill what we started, delete the namespace
#
# The guest side is vm/guest/lp-init: a job agent polling the 9p share ($LPVM_SHARE/jobs).
# Every wait here has a deadline; nothing blocks forever.

LPVM_CACHE=${LIGHTPATH_VM_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/lightpath/rxe-vm}
LPVM_NETNS=${LIGHTPATH_NETNS:-lp-interop}
LPVM_TAP=${LIGHTPATH_TAP:-lptap0}
LPVM_HOST_IP=10.78.0.1
LPVM_VM_IP=10.78.0.2
LPVM_PREFIX=24
LPVM_MAC=52:54:00:4c:50:02
LPVM_MTU=${LPVM_MTU:-1500}
LPVM_MEM=${LPVM_MEM:-1024}
LPVM_SMP=${LPVM_SMP:-2}
LPVM_BOOT_TIMEOUT=${LPVM_BOOT_TIMEOUT:-120}
LPVM_NORXE=${LPVM_NORXE:-0}
LPVM_SHARE=${LPVM_SHARE:-}
LPVM_QEMU_PID=
LPVM_PCAP_PID=
LPVM_BG_PIDS=()
LPVM_NET_CREATED=0
LPVM_BOOT_SECONDS=
LPVM_ACCEL=

lpvm_log() { printf 'lpvm: %s\n' "$*" >&2; }
lpvm_now() { date +%s.%N; }
lpvm_elapsed() { awk -v a="$1" -v b="$(lpvm_now)" 'BEGIN { printf "%.2f", b - a }'; }

# Runs a command on the host inside the namespace.
lpvm_ns() { ip netns exec "$LPVM_NETNS" "$@"; }

# Prints "kvm" only where a hardware KVM module is loaded and qemu can use it. Some hosts
# expose a /dev/kvm that cannot run a stock kernel (e.g. kvm-pvm, which only runs
# PVM-enabled guests: the boot hangs), so /dev/kvm existing is not enough.
lpvm_pick_accel() {
    if [ -n "${LIGHTPATH_VM_ACCEL:-}" ]; then echo "$LIGHTPATH_VM_ACCEL"; return; fi
    if [ -w /dev/kvm ] && { [ -d /sys/module/kvm_intel ] || [ -d /sys/module/kvm_amd ]; } &&
        grep -qwE 'vmx|svm' /proc/cpuinfo; then
        echo kvm
    else
        echo tcg
    fi
}

# Checks the image artifacts exist (build-image.sh makes them).
lpvm_check_image() {
    local f
    for f in initrd.img root.ext4 vmlinuz; do
        [ -e "$LPVM_CACHE/$f" ] || { lpvm_log "$LPVM_CACHE/$f is missing: run interop/vm/build-image.sh"; return 1; }
    done
}

# Creates the namespace and the tap (host end 10.78.0.1/24) inside it.
lpvm_net_up() {
    exec {LPVM_LOCK_FD}> "/run/lightpath-interop-$LPVM_NETNS.lock"
    if ! flock -n "$LPVM_LOCK_FD"; then
        lpvm_log "namespace $LPVM_NETNS is in use by another run; waiting up to ${LPVM_LOCK_WAIT:-900}s for it"
        if ! flock -w "${LPVM_LOCK_WAIT:-900}" "$LPVM_LOCK_FD"; then
            lpvm_log "namespace $LPVM_NETNS is still in use (lock /run/lightpath-interop-$LPVM_NETNS.lock)"
            return 1
        fi
    fi
    # A qemu left running by a run that was killed outright (SIGKILL: no trap ran). We hold
    # the lock, so the pid file is ours; check the pid still is that qemu before ending it.
    local pidfile=$LPVM_CACHE/qemu-$LPVM_NETNS.pid stale
    if stale=$(cat "$pidfile" 2> /dev/null) && [ -n "$stale" ] &&
        tr '\0' ' ' < "/proc/$stale/cmdline" 2> /dev/null | grep -q -- '-name lightpath-interop'; then
        lpvm_log "stopping qemu $stale left over from an earlier run"
        kill "$stale" 2> /dev/null || true
        sleep 0.5
    fi
    rm -f "$pidfile"
    # a namespace left behind by a killed run: we hold the lock, so nobody uses it
    if ip netns list | awk '{print $1}' | grep -qx "$LPVM_NETNS"; then
        ip netns del "$LPVM_NETNS"
    fi
    ip netns add "$LPVM_NETNS" || return 1
    LPVM_NET_CREATED=1
    lpvm_ns ip link set lo up &&
        lpvm_ns ip tuntap add dev "$LPVM_TAP" mode tap &&
        lpvm_ns ip link set "$LPVM_TAP" mtu "$LPVM_MTU" &&
        lpvm_ns ip addr add "$LPVM_HOST_IP/$LPVM_PREFIX" dev "$LPVM_TAP" &&
        lpvm_ns ip link set "$LPVM_TAP" up
}

lpvm_pcap_start() {
    local file=$1
    # not through lpvm_ns: a backgrounded function is a subshell, and $! would be its pid
    ip netns exec "$LPVM_NETNS" tcpdump -Z root -B 131072 -i "$LPVM_TAP" -U --immediate-mode -s 0 -w "$file" \
        udp port 4791 > "$file.tcpdump.log" 2>&1 {LPVM_LOCK_FD}>&- &
    LPVM_PCAP_PID=$!
    local i
    for i in $(seq 50); do
        grep -q 'listening on' "$file.tcpdump.log" 2> /dev/null && return 0
        kill -0 "$LPVM_PCAP_PID" 2> /dev/null || { lpvm_log "tcpdump failed: $(cat "$file.tcpdump.log")"; return 1; }
        sleep 0.1
    done
}

lpvm_pcap_stop() {
    [ -n "$LPVM_PCAP_PID" ] || return 0
    sleep 0.5 # let the last packets through the immediate-mode buffer
    kill -INT "$LPVM_PCAP_PID" 2> /dev/null || true
    local i
    for i in $(seq 30); do kill -0 "$LPVM_PCAP_PID" 2> /dev/null || break; sleep 0.1; done
    kill -KILL "$LPVM_PCAP_PID" 2> /dev/null || true
    wait "$LPVM_PCAP_PID" 2> /dev/null || true
    LPVM_PCAP_PID=
}

# Boots the VM (needs lpvm_net_up first and LPVM_SHARE set) and waits until the guest has
# rxe0 ACTIVE. Sets LPVM_BOOT_SECONDS.
lpvm_boot() {
    lpvm_check_image || return 1
    [ -n "$LPVM_SHARE" ] || { lpvm_log "LPVM_SHARE is not set"; return 1; }
    mkdir -p "$LPVM_SHARE/jobs" "$LPVM_SHARE/state"
    rm -f "$LPVM_SHARE"/state/* "$LPVM_SHARE"/jobs/*
    LPVM_ACCEL=$(lpvm_pick_accel)
    local accel_opts cpu kernel append t0 qemu=${LIGHTPATH_QEMU:-qemu-system-x86_64}
    if [ "$LPVM_ACCEL" = kvm ]; then
        accel_opts=kvm cpu=host
    else
        accel_opts=tcg,thread=multi,tb-size=256 cpu=max
    fi
    kernel=$LPVM_CACHE/vmlinux
    [ -e "$kernel" ] || kernel=$LPVM_CACHE/vmlinuz
    append="console=ttyS0,115200 root=/dev/vda rw quiet loglevel=4 panic=-1 mitigations=off"
    append+=" net.ifnames=0 lp.ip=$LPVM_VM_IP/$LPVM_PREFIX lp.mtu=$LPVM_MTU"
    [ "$LPVM_NORXE" = 1 ] && append+=" lp.norxe=1"
    append+=" ${LIGHTPATH_VM_APPEND:-}"
    t0=$(lpvm_now)
    ip netns exec "$LPVM_NETNS" "$qemu" -name lightpath-interop -accel "$accel_opts" -cpu "$cpu" \
        -pidfile "$LPVM_CACHE/qemu-$LPVM_NETNS.pid" \
        -m "$LPVM_MEM" -smp "$LPVM_SMP" -nodefaults -no-user-config -nographic -no-reboot \
        -monitor none -serial "file:$LPVM_SHARE/console.log" \
        -kernel "$kernel" -initrd "$LPVM_CACHE/initrd.img" -append "$append" \
        -drive "file=$LPVM_CACHE/root.ext4,if=virtio,format=raw,snapshot=on" \
        -fsdev "local,id=share0,path=$LPVM_SHARE,security_model=none,multidevs=remap" \
        -device virtio-9p-pci,fsdev=share0,mount_tag=lpshare \
        -netdev "tap,id=net0,ifname=$LPVM_TAP,script=no,downscript=no" \
        -device "virtio-net-pci,netdev=net0,mac=$LPVM_MAC" \
        > "$LPVM_SHARE/qemu.log" 2>&1 {LPVM_LOCK_FD}>&- &
    LPVM_QEMU_PID=$!
    while :; do
        if [ -e "$LPVM_SHARE/state/ready" ]; then break; fi
        if [ -e "$LPVM_SHARE/state/failed" ]; then
            lpvm_log "guest setup failed:"; sed 's/^/  /' "$LPVM_SHARE/state/failed" >&2; return 1
        fi
        if ! kill -0 "$LPVM_QEMU_PID" 2> /dev/null; then
            lpvm_log "qemu exited during boot; last lines of qemu.log and console.log:"
            tail -n 5 "$LPVM_SHARE/qemu.log" "$LPVM_SHARE/console.log" >&2 2> /dev/null
            LPVM_QEMU_PID=
            return 1
        fi
        if awk -v a="$t0" -v b="$(lpvm_now)" -v t="$LPVM_BOOT_TIMEOUT" 'BEGIN { exit !(b - a > t) }'; then
            lpvm_log "boot timed out after ${LPVM_BOOT_TIMEOUT}s; see $LPVM_SHARE/console.log"
            tail -n 5 "$LPVM_SHARE/console.log" >&2 2> /dev/null
            return 1
        fi
        sleep 0.1
    done
    LPVM_BOOT_SECONDS=$(lpvm_elapsed "$t0")
}

lpvm_alive() { [ -n "$LPVM_QEMU_PID" ] && kill -0 "$LPVM_QEMU_PID" 2> /dev/null; }

# lpvm_job_start ID CODE [TIMEOUT]: hands CODE (bash) to the guest agent; returns at once.
# The job runs in /shared with guest/jobs.sh's helpers available.
lpvm_job_start() {
    local id=$1 code=$2 limit=${3:-300} dir=$LPVM_SHARE/jobs
    rm -f "$dir/$id".*
    echo "$limit" > "$dir/$id.timeout"
    { echo 'source /shared/jobs.sh 2>/dev/null'; echo "$code"; } > "$dir/.$id.tmp"
    mv "$dir/.$id.tmp" "$dir/$id.sh"
}

# lpvm_job_wait ID [TIMEOUT]: waits for the job's exit code and returns it
# (124 = the guest killed it at its timeout, 125 = no result: host-side timeout or VM died).
lpvm_job_wait() {
    local id=$1 limit=${2:-330} dir=$LPVM_SHARE/jobs t0
    t0=$(lpvm_now)
    until [ -e "$dir/$id.rc" ]; do
        if ! lpvm_alive; then lpvm_log "VM is gone while waiting for job $id"; return 125; fi
        if awk -v a="$t0" -v b="$(lpvm_now)" -v t="$limit" 'BEGIN { exit !(b - a > t) }'; then
            lpvm_log "job $id: no result after ${limit}s"; return 125
        fi
        sleep 0.05
    done
    return "$(cat "$dir/$id.rc")"
}

# lpvm_job ID CODE [TIMEOUT]: runs CODE in the guest, prints its output, returns its rc.
lpvm_job() {
    local id=$1 limit=${3:-300} rc=0
    lpvm_job_start "$id" "$2" "$limit"
    lpvm_job_wait "$id" $((limit + 30)) || rc=$?
    cat "$LPVM_SHARE/jobs/$id.log" 2> /dev/null
    return "$rc"
}

# Waits (up to $2 s) for the guest job to create $LPVM_SHARE/jobs/$1.listening
# (see lp_listening in guest/jobs.sh); fails early if the job has already ended.
lpvm_job_wait_listening() {
    local id=$1 limit=${2:-30} t0
    t0=$(lpvm_now)
    until [ -e "$LPVM_SHARE/jobs/$id.listening" ]; do
        [ -e "$LPVM_SHARE/jobs/$id.rc" ] && return 1
        lpvm_alive || return 1
        awk -v a="$t0" -v b="$(lpvm_now)" -v t="$limit" 'BEGIN { exit !(b - a > t) }' && return 1
        sleep 0.05
    done
}

# Waits (up to $2 s) until something listens on TCP port $1 in the host namespace.
lpvm_ns_wait_listening() {
    local port=$1 limit=${2:-30} t0
    t0=$(lpvm_now)
    until lpvm_ns ss -Hltn "sport = :$port" 2> /dev/null | grep -q .; do
        awk -v a="$t0" -v b="$(lpvm_now)" -v t="$limit" 'BEGIN { exit !(b - a > t) }' && return 1
        sleep 0.05
    done
}

# Starts a host process in the namespace, in the background, under `timeout`; its pid goes
# to LPVM_BG_PID and into the cleanup list.
lpvm_ns_start() { # LOGFILE TIMEOUT CMD...
    local logfile=$1 limit=$2
    shift 2
    ip netns exec "$LPVM_NETNS" timeout --kill-after=3 "$limit" "$@" > "$logfile" 2>&1 < /dev/null {LPVM_LOCK_FD}>&- &
    LPVM_BG_PID=$!
    LPVM_BG_PIDS+=("$LPVM_BG_PID")
}

lpvm_stop() {
    lpvm_alive || { LPVM_QEMU_PID=; return 0; }
    : > "$LPVM_SHARE/jobs/STOP"
    local i
    for i in $(seq 100); do lpvm_alive || break; sleep 0.1; done
    if lpvm_alive; then kill "$LPVM_QEMU_PID" 2> /dev/null; fi
    wait "$LPVM_QEMU_PID" 2> /dev/null || true
    LPVM_QEMU_PID=
}

# Kills everything this session started and removes the namespace. Safe to call twice.
lpvm_cleanup() {
    local pid
    for pid in "${LPVM_BG_PIDS[@]}"; do kill "$pid" 2> /dev/null || true; done
    LPVM_BG_PIDS=()
    if lpvm_alive; then kill "$LPVM_QEMU_PID" 2> /dev/null || true; wait "$LPVM_QEMU_PID" 2> /dev/null || true; fi
    LPVM_QEMU_PID=
    lpvm_pcap_stop
    if [ "$LPVM_NET_CREATED" = 1 ]; then
        ip netns del "$LPVM_NETNS" 2> /dev/null || true
        LPVM_NET_CREATED=0
    fi
}

# Puts guest/jobs.sh (helpers for job scripts) into the share.
lpvm_install_guest_helpers() {
    cp "$(dirname "${BASH_SOURCE[0]}")/guest/jobs.sh" "$LPVM_SHARE/jobs.sh"
}
