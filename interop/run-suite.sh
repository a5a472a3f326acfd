#!/bin/bash
# Lightpath <-> Linux rxe interoperability suite: the one entry point for CI and people.
#
#   interop/run-suite.sh [options]
#
# Boots one Debian VM with SoftRoCE (rxe0, 10.78.0.2) under qemu, reachable from a network
# namespace where the Lightpath side runs on 10.78.0.1, and runs every case in that one VM
# session while tcpdump captures UDP/4791 on the tap. Prints a summary table and
# "interop: N passed, N failed, N skipped" (skipped = NOT RUN).
#
# Options:
#   --only REGEX     run only the cases whose id matches REGEX (see --list)
#   --list           print the case ids and exit
#   --results DIR    where logs, the capture and the vectors go
#                    (default: $LIGHTPATH_VM_CACHE/results/<date-time>, plus a "latest" link)
#   --pp-iters N     ibv_rc_pingpong / lightpath pingpong iterations (default 100)
#   --op-iters N     verbs_peer / interop-peer iterations per operation (default 5)
#
# Environment:
#   LIGHTPATH_BIN                the lightpath binary; default: cargo build --release -p
#                                lightpath-cli, then <target>/release/lightpath
#   LIGHTPATH_INTEROP_REQUIRED=1 a missing prerequisite fails (exit 1) instead of
#                                "SKIPPED: <reason>" and exit 0
#   LIGHTPATH_VM_CACHE           image cache (default ~/.cache/lightpath/rxe-vm)
#   LIGHTPATH_NETNS              namespace name (default lp-interop); a second run waits for
#                                the first to release it
#   LIGHTPATH_INTEROP_DEADLINE   seconds after which no further case starts (default 2700)
#   LIGHTPATH_INTEROP_STACKS_AFTER  seconds after which a stream-ibverbs-to-soft case still
#                                running leaves both ends' thread stacks in its case directory
#                                (default 40)
#
# Exit code: 0 if no case failed (NOT RUN cases do not fail the suite), 1 otherwise.
set -uo pipefail
interop=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(dirname "$interop")
# shellcheck source=vm/lib.sh
source "$interop/vm/lib.sh"

only="" list=0 results="" pp_iters=100 op_iters=5
while [ $# -gt 0 ]; do
    case "$1" in
        --only) only=$2; shift 2 ;;
        --list) list=1; shift ;;
        --results) results=$2; shift 2 ;;
        --pp-iters) pp_iters=$2; shift 2 ;;
        --op-iters) op_iters=$2; shift 2 ;;
        -h | --help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) echo "run-suite.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done

suite_start=$SECONDS
skip() {
    echo "SKIPPED: $*"
    if [ "${LIGHTPATH_INTEROP_REQUIRED:-0}" = 1 ]; then
        echo "run-suite.sh: LIGHTPATH_INTEROP_REQUIRED=1, so a missing prerequisite is a failure" >&2
        exit 1
    fi
    exit 0
}

# ------------------------------------------------------------------------------ the cases
# Each case: "id|direction|function args...". Ids are stable: use them with --only.
pp_sizes=(64 4096 10000)
pp_mtus=(256 1024 4096)
ops=(send send_imm write write_imm read cmp_swap fetch_add)
cases=()
cases+=("lightpath-build|host|case_build_lightpath")
for s in "${pp_sizes[@]}"; do for m in "${pp_mtus[@]}"; do
    cases+=("pingpong-loopback-s$s-m$m|rxe -> rxe (loopback)|case_pingpong_loopback $s $m")
done; done
for op in "${ops[@]}"; do
    cases+=("verbs_peer-loopback-$op|rxe -> rxe (loopback)|case_peer_loopback $op")
done
for op in "${ops[@]}"; do
    cases+=("verbs_peer-fault-$op|rxe -> rxe, fault injected: must FAIL|case_peer_fault $op")
done
for s in "${pp_sizes[@]}"; do for m in "${pp_mtus[@]}"; do
    cases+=("pingpong-lp-server-s$s-m$m|rxe client -> Lightpath server|case_pingpong_lp_server $s $m")
    cases+=("pingpong-lp-client-s$s-m$m|Lightpath client -> rxe server|case_pingpong_lp_client $s $m")
done; done
for op in "${ops[@]}"; do
    cases+=("interop-peer-lp-server-$op|rxe requester -> Lightpath responder|case_peer_lp_server $op")
    cases+=("interop-peer-lp-client-$op|Lightpath requester -> rxe responder|case_peer_lp_client $op")
done
# perftest (ib_write_bw, ...) in the VM against `lightpath perf --perftest` (soft, host), both
# roles: three sizes over two MTUs, and -a (every size, 2 B..8 MiB, few iterations).
pt_tests=(write_bw read_bw write_lat read_lat send_lat send_bw)
pt_points=("64 1024" "4096 256" "65536 1024")
for t in "${pt_tests[@]}"; do
    for point in "${pt_points[@]}"; do
        read -r s m <<< "$point"
        cases+=("perftest-lp-server-$t-s$s-m$m|ib_$t (rxe) -> lightpath perf --perftest server|case_perftest server $t $s $m")
        cases+=("perftest-lp-client-$t-s$s-m$m|lightpath perf --perftest client -> ib_$t (rxe)|case_perftest client $t $s $m")
    done
    cases+=("perftest-lp-server-$t-all|ib_$t -a (rxe) -> lightpath perf --perftest server|case_perftest server $t all 1024")
    cases+=("perftest-lp-client-$t-all|lightpath perf --perftest -a client -> ib_$t (rxe)|case_perftest client $t all 1024")
done
cases+=("perftest-mismatch|ib_write_bw -c UC / larger size -> lightpath: clear errors, no hang|case_perftest_mismatch")
cases+=("perftest-send-mismatch|ib_send_bw/ib_send_lat -c UC / other sizes <-> lightpath: clear errors, no hang|case_perftest_send_mismatch")
# The ibverbs provider inside the VM, on rxe0: conformance, ibv_rc_pingpong, the soft provider
# across the tap (every operation, both directions), perf against perftest, bad input.
cases+=("ibverbs-build-tests|host|case_build_ibverbs_tests")
cases+=("ibverbs-devices|lightpath devices in the VM|case_ibverbs_devices")
cases+=("ibverbs-conformance|ibverbs on rxe0 (loopback)|case_ibverbs_conformance")
for s in 64 10000; do for m in 1024 4096; do
    cases+=("ibverbs-pingpong-server-s$s-m$m|ibv_rc_pingpong -> Lightpath ibverbs (rxe0)|case_ibverbs_pingpong server $s $m")
    cases+=("ibverbs-pingpong-client-s$s-m$m|Lightpath ibverbs -> ibv_rc_pingpong (rxe0)|case_ibverbs_pingpong client $s $m")
done; done
cases+=("ibverbs-pingpong-events|Lightpath ibverbs -e <-> ibv_rc_pingpong -e|case_ibverbs_pingpong events 4096 1024")
for op in "${ops[@]}"; do
    cases+=("ibverbs-soft-ibv-server-$op|Lightpath soft (host) -> Lightpath ibverbs (VM)|case_ibverbs_soft_ibv_server $op")
    cases+=("ibverbs-soft-soft-server-$op|Lightpath ibverbs (VM) -> Lightpath soft (host)|case_ibverbs_soft_soft_server $op")
done
for t in send_lat write_lat read_lat send_bw write_bw read_bw; do
    cases+=("ibverbs-perf-$t|Lightpath ibverbs vs perftest (rxe0)|case_ibverbs_perf $t")
done
for t in stream_lat stream_bw stream_rr; do
    cases+=("stream-ibverbs-$t|lightpath::Stream, both ends on rxe0: negotiation picks ibverbs|case_stream_ibverbs $t")
    cases+=("stream-soft-to-ibverbs-$t|Lightpath soft stream (host) -> ibverbs listener (VM)|case_stream_soft_to_ibverbs $t")
    cases+=("stream-ibverbs-to-soft-$t|Lightpath ibverbs stream (VM) -> soft listener (host)|case_stream_ibverbs_to_soft $t")
done
cases+=("stream-ibverbs-zero-copy|lightpath::Stream write_buf/read_buf on rxe0: rendezvous by RDMA READ|case_stream_ibverbs stream_bw zero_copy")
cases+=("ibverbs-overhead|Lightpath ibverbs wrapper vs direct C calls (rxe0)|case_ibverbs_overhead")
cases+=("ibverbs-bad-input|Lightpath ibverbs: refused inputs (rxe0)|case_ibverbs_bad_input")
cases+=("ibverbs-no-leaks|rdma resource after the ibverbs cases|case_ibverbs_no_leaks")
cases+=("rxe-to-stub-traffic|rxe requester -> stub host peer (no RDMA)|case_rxe_to_stub")
cases+=("capture-icrc-independent|both (tap capture)|case_capture_independent")
cases+=("capture-lightpath-decode|both (tap capture)|case_capture_decode")

selected=()
for c in "${cases[@]}"; do
    id=${c%%|*}
    if [ -z "$only" ] || [[ "$id" =~ $only ]]; then selected+=("$c"); fi
done
if [ "$list" = 1 ]; then
    for c in "${selected[@]}"; do
        IFS='|' read -r id dir _ <<< "$c"
        printf '%-40s %s\n' "$id" "$dir"
    done
    exit 0
fi
[ ${#selected[@]} -gt 0 ] || { echo "run-suite.sh: no case matches --only '$only'" >&2; exit 2; }

# ------------------------------------------------------------------------------ prerequisites
[ "$(id -u)" = 0 ] || skip "not running as root (needed for a network namespace, a tap device and qemu)"
[ -c /dev/net/tun ] || skip "/dev/net/tun is missing (no TUN/TAP support in this kernel or container)"
command -v ip > /dev/null || command -v apt-get > /dev/null || skip "neither iproute2 (ip) nor apt-get is available"
for tool in qemu-system-x86_64:qemu-system-x86 debootstrap:debootstrap mkfs.ext4:e2fsprogs \
    tcpdump:tcpdump; do
    if ! command -v "${tool%%:*}" > /dev/null && ! command -v apt-get > /dev/null; then
        skip "${tool%%:*} is missing and apt-get is not available to install ${tool#*:}"
    fi
done
probe_ns=lp-probe-$$
if command -v ip > /dev/null; then
    ip netns add "$probe_ns" 2> /dev/null || skip "cannot create a network namespace (ip netns add failed)"
    ip netns del "$probe_ns"
fi

if [ -z "$results" ]; then
    results=$LPVM_CACHE/results/$(date +%Y%m%d-%H%M%S)
    mkdir -p "$results"
    ln -sfn "$(basename "$results")" "$LPVM_CACHE/results/latest"
    # Keep the last 5 result directories, and the last 5 older ones where a case failed: a loop
    # of passing runs (hunting a rare hang) must not prune the one that caught it.
    old_failed=0
    for dir in $(ls -1d "$LPVM_CACHE"/results/2* 2> /dev/null | head -n -5 | sort -r); do
        if grep -q ' FAIL ' "$dir/summary.txt" 2> /dev/null && [ $old_failed -lt 5 ]; then
            old_failed=$((old_failed + 1))
        else
            rm -rf "$dir"
        fi
    done
fi
mkdir -p "$results/cases" || { echo "run-suite.sh: cannot create $results" >&2; exit 2; }
results=$(cd "$results" && pwd)
echo "interop: results in $results"

t=$SECONDS
if ! "$interop/vm/build-image.sh" > "$results/build-image.log" 2>&1; then
    tail -n 15 "$results/build-image.log"
    skip "the VM image could not be built (see $results/build-image.log): $(tail -n 1 "$results/build-image.log")"
fi
image_seconds=$((SECONDS - t))
echo "interop: VM image ready in ${image_seconds}s ($(tail -n 1 "$results/build-image.log" | sed 's/^\[[^]]*\] //'))"

# ------------------------------------------------------------------------------ bookkeeping
summary=$results/summary.tsv
: > "$summary"
n_pass=0 n_fail=0 n_notrun=0
# record ID DIRECTION RESULT SECONDS NOTE
record() {
    printf '%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" "$5" >> "$summary"
    case "$3" in
        PASS) n_pass=$((n_pass + 1)) ;;
        FAIL) n_fail=$((n_fail + 1)) ;;
        *) n_notrun=$((n_notrun + 1)) ;;
    esac
    printf '  %-36s %-6s %6ss  %s\n' "$1" "$3" "$4" "$5"
}

# A case function runs in the current shell with $case_dir set. It returns 0 (PASS), 1 (FAIL)
# or 77 (NOT RUN); it may write a one-line note to $case_dir/note.
NOT_RUN=77
note() { echo "$*" > "$case_dir/note"; }
next_port=20000
take_port() { next_port=$((next_port + 1)); port=$next_port; }

# A case that fails in the VM is run once more (LIGHTPATH_INTEROP_RETRIES, default 1): under
# TCG the guest can stall for seconds when the host is loaded, and a timing-bound case (a
# perftest latency run waiting on its peer, say) then fails for the machine, not for Lightpath.
# A case that passes on a later try is recorded as PASS with the first failure in its note and
# listed under "passed on a retry" at the end, so a flake stays visible; one that fails every
# try is a FAIL. The first try's log is kept as case.log.try1.
retries=${LIGHTPATH_INTEROP_RETRIES:-1}
retried=()

run_case() {
    local id=$1 direction=$2 fn=$3 rc=0 t0 seconds result tries=0 first=""
    shift 3
    case_dir=$results/cases/$id
    mkdir -p "$case_dir"
    t0=$(lpvm_now)
    while :; do
        rm -f "$case_dir/note"
        rc=0
        "$fn" "$@" > "$case_dir/case.log" 2>&1 || rc=$?
        tries=$((tries + 1))
        [ "$rc" != 0 ] && [ "$rc" != "$NOT_RUN" ] && [ "${retry_case:-0}" = 1 ] && [ "$tries" -le "$retries" ] \
            && lpvm_alive || break
        first="try $tries failed: $(head -n 1 "$case_dir/note" 2> /dev/null || true)"
        mv "$case_dir/case.log" "$case_dir/case.log.try$tries"
        printf '  %-36s %-6s %6s   %s\n' "$id" retry "" "$first"
    done
    seconds=$(lpvm_elapsed "$t0")
    case $rc in
        0) result=PASS ;;
        "$NOT_RUN") result="NOT RUN" ;;
        *) result=FAIL ;;
    esac
    local text=""
    [ -s "$case_dir/note" ] && text=$(head -n 1 "$case_dir/note")
    [ "$result" = FAIL ] && [ -z "$text" ] && text="see $case_dir/case.log"
    if [ -n "$first" ]; then
        text="$text [$first]"
        [ "$result" = PASS ] && retried+=("$id: $first")
    fi
    record "$id" "$direction" "$result" "$seconds" "$text"
}

# ------------------------------------------------------------------------------ lightpath binary
LP="" lp_missing_reason=""
case_build_lightpath() {
    if [ -n "${LIGHTPATH_BIN:-}" ]; then
        LP=$LIGHTPATH_BIN
        [ -x "$LP" ] || { note "LIGHTPATH_BIN=$LP is not an executable file"; LP=""; lp_missing_reason="LIGHTPATH_BIN is not executable"; return 1; }
        note "not built: using LIGHTPATH_BIN=$LP"
        return $NOT_RUN
    fi
    if ! command -v cargo > /dev/null; then
        lp_missing_reason="cargo is not installed and LIGHTPATH_BIN is not set"
        note "$lp_missing_reason"
        return $NOT_RUN
    fi
    local target=${CARGO_TARGET_DIR:-$repo/target}
    case "$target" in /*) ;; *) target=$repo/$target ;; esac
    echo "cargo build --release -p lightpath-cli (target $target)"
    if ! (cd "$repo" && cargo build --release -p lightpath-cli); then
        lp_missing_reason="cargo build --release -p lightpath-cli failed"
        note "$lp_missing_reason"
        return 1
    fi
    LP=$target/release/lightpath
    note "built $LP"
}

# Succeeds if the lightpath binary has subcommand $1; otherwise notes why the case cannot run.
need_lightpath() {
    if [ -z "$LP" ]; then
        note "NOT RUN: no lightpath binary (${lp_missing_reason:-build case not selected and LIGHTPATH_BIN not set})"
        return 1
    fi
    local help
    if ! help=$("$LP" "$1" --help 2>&1); then
        note "NOT RUN: lightpath has no \`$1\` subcommand yet"
        return 1
    fi
    # a subcommand registered as a placeholder has no options yet
    if ! grep -q -- '--bind' <<< "$help"; then
        note "NOT RUN: lightpath \`$1\` is not implemented yet (its --help has no --bind)"
        return 1
    fi
}

# ------------------------------------------------------------------------------ case functions
G="" # the guest's IPv4-mapped GID index, found after boot
VP=/shared/bin/verbs_peer
T_CASE=90 # a case normally takes 1-5 s; ibv_rc_pingpong has no timeout of its own
# After this many seconds the remaining cases are not started (recorded as FAIL), so a
# pathological run still ends well inside CI's time limit.
deadline=${LIGHTPATH_INTEROP_DEADLINE:-2700}
lp_traffic=0 # cases that put Lightpath <-> rxe traffic on the wire

case_pingpong_loopback() {
    local s=$1 m=$2 port
    take_port
    local common="ibv_rc_pingpong -d rxe0 -g $G -p $port -m $m -s $s -n $pp_iters -c"
    lpvm_job "pp-$s-$m-$port" "lp_pair $port '$common' '$common $LPVM_VM_IP'" $T_CASE
}

case_peer_loopback() {
    local op=$1 port
    take_port
    local common="$VP -o $op -n $op_iters -m 1024 -p $port -t 120"
    lpvm_job "vp-$op-$port" "lp_pair $port '$common' '$common $LPVM_VM_IP'" $T_CASE
}

# The client makes a deliberate mistake (-x): both sides must report FAIL (exit 1), not
# a setup error (2) and not PASS. Proves the checks of verbs_peer can fail.
case_peer_fault() {
    local op=$1 port out
    take_port
    local common="$VP -o $op -n 2 -m 1024 -p $port -t 30"
    out=$(lpvm_job "vpx-$op-$port" "lp_pair $port '$common' '$common -x $LPVM_VM_IP'" $T_CASE)
    echo "$out"
    if echo "$out" | grep -q '^server rc=1 client rc=1$'; then
        note "both sides reported FAIL, as they must"
        return 0
    fi
    note "expected both sides to FAIL with exit code 1: $(echo "$out" | tail -n 1)"
    return 1
}

# Lightpath's side of the ping-pong cases logs its queue pair's transport state when it goes
# (requester, responder, timers: `lightpath_roce` at trace level, one line per queue pair and
# one per retransmission), so that a run that stalls says where. A stall seen twice on
# 2026-12-07 (`pingpong-lp-client-s10000-m256`, passed on the retry): Lightpath waited 60 s
# for a reply with no retransmission, timeout or NAK counted on its queue pair.
pp_log=${LIGHTPATH_LOG:-lightpath_roce=trace}

# Lightpath serves (host namespace), ibv_rc_pingpong connects from the VM.
case_pingpong_lp_server() {
    local s=$1 m=$2 port host_rc=0 vm_rc=0 pid
    need_lightpath pingpong || return $NOT_RUN
    take_port
    lp_traffic=$((lp_traffic + 1))
    lpvm_ns_start "$case_dir/lightpath.log" $T_CASE env LIGHTPATH_LOG="$pp_log" "$LP" pingpong --bind "$LPVM_HOST_IP" \
        -p "$port" -m "$m" -s "$s" -n "$pp_iters"
    pid=$LPVM_BG_PID
    if ! lpvm_ns_wait_listening "$port" 30; then
        note "lightpath pingpong never listened on TCP $port (see lightpath.log)"
        kill "$pid" 2> /dev/null
        return 1
    fi
    lpvm_job "pps-$s-$m-$port" "ibv_rc_pingpong -d rxe0 -g $G -p $port -m $m -s $s -n $pp_iters $LPVM_HOST_IP" \
        $T_CASE > "$case_dir/rxe.log" 2>&1 || vm_rc=$?
    wait "$pid" || host_rc=$?
    sed 's/^/[rxe] /' "$case_dir/rxe.log"
    sed 's/^/[lightpath] /' "$case_dir/lightpath.log"
    [ "$vm_rc" = 0 ] && [ "$host_rc" = 0 ] && return 0
    note "ibv_rc_pingpong rc=$vm_rc, lightpath rc=$host_rc"
    return 1
}

# ibv_rc_pingpong serves in the VM, Lightpath connects from the host namespace.
case_pingpong_lp_client() {
    local s=$1 m=$2 port host_rc=0 vm_rc=0 id
    need_lightpath pingpong || return $NOT_RUN
    take_port
    lp_traffic=$((lp_traffic + 1))
    id=ppc-$s-$m-$port
    lpvm_job_start "$id" "lp_serve $port ibv_rc_pingpong -d rxe0 -g $G -p $port -m $m -s $s -n $pp_iters" $T_CASE
    if ! lpvm_job_wait_listening "$id" 30; then
        note "ibv_rc_pingpong in the VM never listened on TCP $port"
        lpvm_job_wait "$id" 60
        cat "$LPVM_SHARE/jobs/$id.log"
        return 1
    fi
    lpvm_ns timeout --kill-after=3 $T_CASE env LIGHTPATH_LOG="$pp_log" "$LP" pingpong --bind "$LPVM_HOST_IP" \
        -p "$port" -m "$m" -s "$s" -n "$pp_iters" "$LPVM_VM_IP" > "$case_dir/lightpath.log" 2>&1 || host_rc=$?
    lpvm_job_wait "$id" $((T_CASE + 30)) || vm_rc=$?
    cp "$LPVM_SHARE/jobs/$id.log" "$case_dir/rxe.log" 2> /dev/null
    sed 's/^/[rxe] /' "$case_dir/rxe.log"
    sed 's/^/[lightpath] /' "$case_dir/lightpath.log"
    [ "$vm_rc" = 0 ] && [ "$host_rc" = 0 ] && return 0
    note "ibv_rc_pingpong rc=$vm_rc, lightpath rc=$host_rc"
    return 1
}

# The "#bytes #iterations" pairs of a perftest-style result table (lines that start with two
# numbers), one per line.
result_pairs() { awk '/^[[:space:]]*[0-9]+[[:space:]]+[0-9]+[[:space:]]/ { print $1, $2 }' "$1"; }

# perftest in the VM against `lightpath perf --perftest` in the host namespace. ROLE is
# Lightpath's: server (perftest connects from the VM) or client (perftest serves in the VM).
# SIZE is a message size or "all" (-a). Passes when both exit 0 and every "#bytes
# #iterations" pair one prints, the other prints too (the passive servers of read_lat print
# no table; their peer's must then have the expected pairs).
case_perftest() {
    local role=$1 t=$2 size=$3 m=$4 port host_rc=0 vm_rc=0 pid id opts iters
    need_lightpath perf || return $NOT_RUN
    take_port
    lp_traffic=$((lp_traffic + 1))
    case $t in *_lat) iters=200 ;; *) iters=500 ;; esac
    if [ "$size" = all ]; then
        iters=5 # perftest's minimum
        opts="-a -n $iters"
    else
        opts="-s $size -n $iters"
    fi
    # -F: perftest's CPU-frequency check fails under TCG.
    local pt="ib_$t -F -d rxe0 -x $G -p $port -m $m $opts"
    local lp=("$LP" perf "$t" --perftest --bind "$LPVM_HOST_IP" -p "$port" -m "$m" $opts)
    if [ "$role" = server ]; then
        lpvm_ns_start "$case_dir/lightpath.log" $T_CASE "${lp[@]}"
        pid=$LPVM_BG_PID
        if ! lpvm_ns_wait_listening "$port" 30; then
            note "lightpath perf --perftest never listened on TCP $port (see lightpath.log)"
            kill "$pid" 2> /dev/null
            return 1
        fi
        lpvm_job "pts-$t-$size-$m-$port" "$pt $LPVM_HOST_IP" $T_CASE > "$case_dir/rxe.log" 2>&1 || vm_rc=$?
        wait "$pid" || host_rc=$?
    else
        id=ptc-$t-$size-$m-$port
        lpvm_job_start "$id" "lp_serve $port $pt" $T_CASE
        if ! lpvm_job_wait_listening "$id" 30; then
            note "ib_$t in the VM never listened on TCP $port"
            lpvm_job_wait "$id" 60
            cat "$LPVM_SHARE/jobs/$id.log"
            return 1
        fi
        lpvm_ns timeout --kill-after=3 $T_CASE "${lp[@]}" "$LPVM_VM_IP" > "$case_dir/lightpath.log" 2>&1 || host_rc=$?
        lpvm_job_wait "$id" $((T_CASE + 30)) || vm_rc=$?
        cp "$LPVM_SHARE/jobs/$id.log" "$case_dir/rxe.log" 2> /dev/null
    fi
    sed 's/^/[perftest] /' "$case_dir/rxe.log"
    sed 's/^/[lightpath] /' "$case_dir/lightpath.log"
    if [ "$vm_rc" != 0 ] || [ "$host_rc" != 0 ]; then
        note "ib_$t rc=$vm_rc, lightpath rc=$host_rc"
        return 1
    fi
    local lp_pairs pt_pairs want
    lp_pairs=$(result_pairs "$case_dir/lightpath.log")
    pt_pairs=$(result_pairs "$case_dir/rxe.log")
    if [ "$size" = all ]; then
        want=$(for i in $(seq 1 23); do echo "$((1 << i)) $iters"; done)
    else
        want="$size $iters"
    fi
    # read_lat's server is passive and prints no table (perftest's and Lightpath's alike);
    # every other side prints exactly the expected sizes and counts.
    local lp_passive=0 pt_passive=0
    if [ "$t" = read_lat ]; then
        if [ "$role" = server ]; then lp_passive=1; else pt_passive=1; fi
    fi
    local pt_want=$want lp_want=$want
    [ "$pt_passive" = 1 ] && pt_want=""
    [ "$lp_passive" = 1 ] && lp_want=""
    # A write/read bandwidth server (perftest's and Lightpath's alike) prints the client's
    # report, which comes once, at the end: with -a, that of the last size. send_bw's server
    # measures its receives and prints its own report for every size, as the client does.
    if [[ $t == *_bw ]] && [ "$t" != send_bw ]; then
        if [ "$role" = server ]; then lp_want=$(tail -n 1 <<< "$want"); else pt_want=$(tail -n 1 <<< "$want"); fi
    fi
    if [ "$pt_pairs" != "$pt_want" ]; then
        note "perftest reported [$(echo $pt_pairs)], expected [$(echo $pt_want)]"
        return 1
    fi
    if [ "$lp_pairs" != "$lp_want" ]; then
        note "lightpath reported [$(echo $lp_pairs)], expected [$(echo $lp_want)]"
        return 1
    fi
    if [ $((lp_passive + pt_passive)) = 0 ] && { [[ $t != *_bw ]] || [ "$t" = send_bw ]; }; then
        note "both report $(echo "$want" | wc -l) size(s) with $iters iterations each"
    elif [[ $t == *_bw ]] && [ "$t" != send_bw ]; then
        note "the client reports $(echo "$want" | wc -l) size(s) with $iters iterations each, the server its final report"
    else
        note "the client reports $(echo "$want" | wc -l) size(s) with $iters iterations each (read_lat's server prints none)"
    fi
    return 0
}

# One mismatched run for case_perftest_send_mismatch: Lightpath (ROLE server or client) runs
# `perf LPARGS`, perftest `PTARGS`; Lightpath must exit 2 with PATTERN in its output, within
# the time limit. Prints why not and returns 1 otherwise.
perftest_mismatch_run() {
    local label=$1 role=$2 lpargs=$3 ptargs=$4 pattern=$5 pid host_rc=0 id
    take_port
    if [ "$role" = server ]; then
        # shellcheck disable=SC2086
        lpvm_ns_start "$case_dir/lightpath-$label.log" 60 "$LP" perf $lpargs --perftest --bind "$LPVM_HOST_IP" -p "$port"
        pid=$LPVM_BG_PID
        lpvm_ns_wait_listening "$port" 30 || { echo "$label: lightpath never listened"; kill "$pid"; return 1; }
        lpvm_job "ptsm-$label-$port" "$ptargs -F -d rxe0 -x $G -p $port $LPVM_HOST_IP" 60 > "$case_dir/rxe-$label.log" 2>&1
        wait "$pid" || host_rc=$?
    else
        id=ptsm-$label-$port
        lpvm_job_start "$id" "lp_serve $port $ptargs -F -d rxe0 -x $G -p $port" 60
        lpvm_job_wait_listening "$id" 30 || { echo "$label: perftest never listened"; lpvm_job_wait "$id" 60; return 1; }
        # shellcheck disable=SC2086
        lpvm_ns timeout --kill-after=3 60 "$LP" perf $lpargs --perftest --bind "$LPVM_HOST_IP" -p "$port" \
            "$LPVM_VM_IP" > "$case_dir/lightpath-$label.log" 2>&1 || host_rc=$?
        lpvm_job_wait "$id" 90
        cp "$LPVM_SHARE/jobs/$id.log" "$case_dir/rxe-$label.log" 2> /dev/null
    fi
    sed "s/^/[$label perftest] /" "$case_dir/rxe-$label.log"
    sed "s/^/[$label lightpath] /" "$case_dir/lightpath-$label.log"
    if [ "$host_rc" != 2 ] || ! grep -q -- "$pattern" "$case_dir/lightpath-$label.log"; then
        echo "$label: expected exit 2 naming \"$pattern\", got rc=$host_rc"
        return 1
    fi
    return 0
}

# The SEND tests' mismatches: a UC perftest client against Lightpath's RC send_bw server;
# perftest sending larger (send_bw) and smaller (send_lat) messages than Lightpath's server
# receives; Lightpath's client sending larger messages than perftest's server receives.
# Lightpath must exit 2 with a clear error every time, not hang and not report a result.
case_perftest_send_mismatch() {
    local port fail=0
    need_lightpath perf || return $NOT_RUN
    lp_traffic=$((lp_traffic + 1))
    perftest_mismatch_run uc server "send_bw -s 4096 -n 50" "ib_send_bw -c UC -s 4096 -n 50" "UC or UD" || fail=1
    perftest_mismatch_run larger server "send_bw -s 64 -n 50" "ib_send_bw -s 65536 -n 50" "receives hold 64 B" || fail=1
    perftest_mismatch_run smaller server "send_lat -s 64 -n 50" "ib_send_lat -s 32 -n 50" \
        "the peer sent a 32 B message where this side expects 64 B" || fail=1
    perftest_mismatch_run client-larger client "send_bw -s 65536 -n 50" "ib_send_bw -s 64 -n 50" "same test, -s / -a" || fail=1
    [ "$fail" = 0 ] && note "all four mismatches ended in clear errors" && return 0
    return 1
}

# Options perftest does not exchange, mismatched on purpose: a UC client (-c UC) and a
# client with larger messages than the server's buffer. Lightpath must exit with a clear
# error (exit 2) within the case's time limit, not hang and not report a result.
case_perftest_mismatch() {
    local port pid host_rc=0 fail=0
    need_lightpath perf || return $NOT_RUN
    lp_traffic=$((lp_traffic + 1))
    # 1. perftest over UC against Lightpath's RC server.
    take_port
    lpvm_ns_start "$case_dir/lightpath-uc.log" 60 "$LP" perf write_bw --perftest --bind "$LPVM_HOST_IP" -p "$port" -s 4096 -n 50
    pid=$LPVM_BG_PID
    lpvm_ns_wait_listening "$port" 30 || { note "lightpath never listened"; kill "$pid"; return 1; }
    lpvm_job "ptm-uc-$port" "ib_write_bw -F -d rxe0 -x $G -p $port -c UC -s 4096 -n 50 $LPVM_HOST_IP" 60 > "$case_dir/rxe-uc.log" 2>&1
    wait "$pid" || host_rc=$?
    sed 's/^/[uc perftest] /' "$case_dir/rxe-uc.log"
    sed 's/^/[uc lightpath] /' "$case_dir/lightpath-uc.log"
    if [ "$host_rc" != 2 ] || ! grep -q "UC or UD" "$case_dir/lightpath-uc.log"; then
        echo "UC peer: expected exit 2 naming UC or UD, got rc=$host_rc"
        fail=1
    fi
    # 2. perftest writes 65536-byte messages into a server started for 64-byte ones... the
    # server's buffer is at least a page, so the client's larger writes fall outside it.
    take_port
    host_rc=0
    lpvm_ns_start "$case_dir/lightpath-size.log" 60 "$LP" perf write_bw --perftest --bind "$LPVM_HOST_IP" -p "$port" -s 64 -n 50
    pid=$LPVM_BG_PID
    lpvm_ns_wait_listening "$port" 30 || { note "lightpath never listened"; kill "$pid"; return 1; }
    lpvm_job "ptm-size-$port" "ib_write_bw -F -d rxe0 -x $G -p $port -s 65536 -n 50 $LPVM_HOST_IP" 60 > "$case_dir/rxe-size.log" 2>&1
    wait "$pid" || host_rc=$?
    sed 's/^/[size perftest] /' "$case_dir/rxe-size.log"
    sed 's/^/[size lightpath] /' "$case_dir/lightpath-size.log"
    if [ "$host_rc" != 2 ] || ! grep -q "same -s / -a" "$case_dir/lightpath-size.log"; then
        echo "larger client messages: expected exit 2 naming -s / -a, got rc=$host_rc"
        fail=1
    fi
    [ "$fail" = 0 ] && note "both mismatches ended in clear errors" && return 0
    return 1
}

# Lightpath is the responder (server, host namespace); verbs_peer requests from the VM.
case_peer_lp_server() {
    local op=$1 port host_rc=0 vm_rc=0 pid
    need_lightpath interop-peer || return $NOT_RUN
    take_port
    lp_traffic=$((lp_traffic + 1))
    lpvm_ns_start "$case_dir/lightpath.log" $T_CASE "$LP" interop-peer --bind "$LPVM_HOST_IP" \
        -o "$op" -n "$op_iters" -m 1024 -p "$port" -t 60
    pid=$LPVM_BG_PID
    if ! lpvm_ns_wait_listening "$port" 30; then
        note "lightpath interop-peer never listened on TCP $port (see lightpath.log)"
        kill "$pid" 2> /dev/null
        return 1
    fi
    lpvm_job "vps-$op-$port" "$VP -o $op -n $op_iters -m 1024 -R 6 -p $port -t 60 $LPVM_HOST_IP" \
        $T_CASE > "$case_dir/rxe.log" 2>&1 || vm_rc=$?
    wait "$pid" || host_rc=$?
    sed 's/^/[rxe] /' "$case_dir/rxe.log"
    sed 's/^/[lightpath] /' "$case_dir/lightpath.log"
    [ "$vm_rc" = 0 ] && [ "$host_rc" = 0 ] && return 0
    note "verbs_peer rc=$vm_rc, lightpath rc=$host_rc: $(grep -h -m1 'FAIL' "$case_dir/rxe.log" "$case_dir/lightpath.log" | head -n 1)"
    return 1
}

# verbs_peer is the responder (server, VM); Lightpath requests from the host namespace.
case_peer_lp_client() {
    local op=$1 port host_rc=0 vm_rc=0 id
    need_lightpath interop-peer || return $NOT_RUN
    take_port
    lp_traffic=$((lp_traffic + 1))
    id=vpc-$op-$port
    lpvm_job_start "$id" "lp_serve $port $VP -o $op -n $op_iters -m 1024 -R 6 -p $port -t 60" $T_CASE
    if ! lpvm_job_wait_listening "$id" 30; then
        note "verbs_peer in the VM never listened on TCP $port"
        lpvm_job_wait "$id" 60
        cat "$LPVM_SHARE/jobs/$id.log"
        return 1
    fi
    lpvm_ns timeout --kill-after=3 $T_CASE "$LP" interop-peer --bind "$LPVM_HOST_IP" \
        -o "$op" -n "$op_iters" -m 1024 -p "$port" -t 60 "$LPVM_VM_IP" > "$case_dir/lightpath.log" 2>&1 || host_rc=$?
    lpvm_job_wait "$id" $((T_CASE + 30)) || vm_rc=$?
    cp "$LPVM_SHARE/jobs/$id.log" "$case_dir/rxe.log" 2> /dev/null
    sed 's/^/[rxe] /' "$case_dir/rxe.log"
    sed 's/^/[lightpath] /' "$case_dir/lightpath.log"
    [ "$vm_rc" = 0 ] && [ "$host_rc" = 0 ] && return 0
    note "verbs_peer rc=$vm_rc, lightpath rc=$host_rc: $(grep -h -m1 'FAIL' "$case_dir/rxe.log" "$case_dir/lightpath.log" | head -n 1)"
    return 1
}

# ------------------------------------------------------------------------------ ibverbs provider
IBV_TESTS="" ibv_tests_missing="" VLP=/shared/bin/lightpath
# The conformance test binary of lightpath-ibverbs, built on the host (cargo test --no-run).
case_build_ibverbs_tests() {
    if ! command -v cargo > /dev/null; then
        ibv_tests_missing="cargo is not installed"
        note "NOT RUN: $ibv_tests_missing"
        return $NOT_RUN
    fi
    local out
    if ! out=$(cd "$repo" && cargo test -p lightpath-ibverbs --test conformance --no-run --message-format=json 2> "$case_dir/build.log"); then
        ibv_tests_missing="cargo test --no-run -p lightpath-ibverbs failed"
        tail -n 20 "$case_dir/build.log"
        note "$ibv_tests_missing"
        return 1
    fi
    IBV_TESTS=$(python3 -c 'import json, sys
for line in sys.stdin:
    try: m = json.loads(line)
    except ValueError: continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "conformance":
        print(m["executable"])' <<< "$out" | tail -n 1)
    [ -x "$IBV_TESTS" ] || { ibv_tests_missing="no conformance executable in cargo's output"; note "$ibv_tests_missing"; IBV_TESTS=""; return 1; }
    # The wrapper-overhead measurement (examples/overhead.rs), optimised like a real program.
    if (cd "$repo" && cargo build --release -p lightpath-ibverbs --example overhead) >> "$case_dir/build.log" 2>&1; then
        local target=${CARGO_TARGET_DIR:-$repo/target}
        case "$target" in /*) ;; *) target=$repo/$target ;; esac
        IBV_OVERHEAD=$target/release/examples/overhead
    fi
    note "built $IBV_TESTS${IBV_OVERHEAD:+ and $IBV_OVERHEAD}"
}

# The same SEND round trips through the safe wrapper and through direct C calls, alternating,
# on rxe0: reports the per-iteration medians (a measurement for the record, not a pass/fail
# threshold: TCG timing is too noisy for one).
IBV_OVERHEAD=""
# Sizes and counts of the stream cases (TCG makes rxe slow: a few MB in all).
stream_extra() {
    if [ "${2:-}" = zero_copy ]; then
        # Registered buffers of 1 MiB, above the ibverbs rendezvous threshold (64 KiB).
        echo "-s 1048576 -n 50 --zero-copy"
        return
    fi
    case $1 in
        stream_lat) echo "-s 64 -n 200" ;;
        # Many connections on one device: their queue pairs share completion queues.
        stream_rr) echo "-s 64 -n 50 --conns 32" ;;
        *) echo "-s 65536 -n 100" ;;
    esac
}

# Checks a stream perf client's JSON: the transport it reports and verified data.
stream_result_ok() {
    local out=$1 transport=$2
    grep -q "\"transport\":\"$transport\"" <<< "$out" && grep -q '"verified":true' <<< "$out"
}

stream_summary() {
    sed -n 's/.*"transport":"\([^"]*\)".*"median":\([0-9.]*\).*/\1, median \2 us/p; s/.*"transport":"\([^"]*\)".*"bw_mb_s":\([0-9.]*\).*/\1, \2 MB\/s/p' <<< "$1" | head -n 1
}

# lightpath::Stream with both ends in the VM, connected to the VM's own address: the
# negotiation finds rxe0's RoCE v2 GID for that address and picks ibverbs.
case_stream_ibverbs() {
    local t=$1 variant=${2:-} port id out rc=0
    need_ibverbs perf || return $NOT_RUN
    take_port
    id=stream-ibv-$t-$port
    lpvm_job_start "$id" "lp_serve $port $VLP perf $t --provider ibverbs -p $port" $T_CASE
    if ! lpvm_job_wait_listening "$id" 30; then
        note "lightpath perf $t (ibverbs) in the VM never listened on TCP $port"
        lpvm_job_wait "$id" 60
        cat "$LPVM_SHARE/jobs/$id.log"
        return 1
    fi
    out=$(lpvm_job "$id-c" "$VLP perf $t $LPVM_VM_IP --provider ibverbs -p $port $(stream_extra "$t" "$variant") --json" $T_CASE) || rc=$?
    lpvm_job_wait "$id" $((T_CASE + 30)) || rc=$?
    echo "$out"
    sed 's/^/[server] /' "$LPVM_SHARE/jobs/$id.log" 2> /dev/null
    if [ "$rc" = 0 ] && stream_result_ok "$out" "rdma/ibverbs"; then
        note "$(stream_summary "$out")"
        return 0
    fi
    note "rc=$rc: $(grep -m1 -E 'error|lightpath:' <<< "$out")"
    return 1
}

# A host with no RDMA device (soft) reaches a listener with one (ibverbs on rxe0): the same
# RoCE v2 wire, so the server serves the soft client from its device.
case_stream_soft_to_ibverbs() {
    local t=$1 port id out rc=0
    need_ibverbs perf || return $NOT_RUN
    take_port
    lp_traffic=$((lp_traffic + 1))
    id=stream-s2i-$t-$port
    lpvm_job_start "$id" "lp_serve $port $VLP perf $t --provider ibverbs,soft -p $port" $T_CASE
    if ! lpvm_job_wait_listening "$id" 30; then
        note "lightpath perf $t (ibverbs) in the VM never listened on TCP $port"
        lpvm_job_wait "$id" 60
        cat "$LPVM_SHARE/jobs/$id.log"
        return 1
    fi
    out=$(lpvm_ns timeout --kill-after=3 $T_CASE "$LP" perf "$t" "$LPVM_VM_IP" --provider soft -p "$port" \
        $(stream_extra "$t") --json 2>&1) || rc=$?
    lpvm_job_wait "$id" $((T_CASE + 30)) || rc=$?
    echo "$out"
    sed 's/^/[server] /' "$LPVM_SHARE/jobs/$id.log" 2> /dev/null
    if [ "$rc" = 0 ] && stream_result_ok "$out" "rdma/soft" && grep -q 'rdma/ibverbs' "$LPVM_SHARE/jobs/$id.log"; then
        note "$(stream_summary "$out"); server on rdma/ibverbs"
        return 0
    fi
    note "rc=$rc: $(grep -m1 -E 'error|lightpath:' <<< "$out")"
    return 1
}

# The other way round: a client with an RDMA device (ibverbs on rxe0, offering nothing else)
# reaches a listener without one (soft on the host). The server serves it from its soft device
# on the RoCE v2 port, where rxe sends.
case_stream_ibverbs_to_soft() {
    local t=$1 port out rc=0 pid watchdog
    need_ibverbs perf || return $NOT_RUN
    take_port
    lp_traffic=$((lp_traffic + 1))
    lpvm_ns_start "$case_dir/soft.log" $T_CASE "$LP" perf "$t" --provider soft -p "$port"
    pid=$LPVM_BG_PID
    if ! lpvm_ns_wait_listening "$port" 30; then
        note "lightpath perf $t (soft) on the host never listened on TCP $port"
        kill "$pid" 2> /dev/null
        return 1
    fi
    local after=${LIGHTPATH_INTEROP_STACKS_AFTER:-40}
    stacks_if_stuck "$pid" "$after" "$case_dir/soft-stacks.txt" "$case_dir/client-stacks.txt" \
        "$LPVM_SHARE/jobs/stream-i2s-$t-$port.log" &
    watchdog=$!
    # A client still running 3/4 of the way to the stacks prints Lightpath's completion state.
    out=$(lpvm_job "stream-i2s-$t-$port" "LIGHTPATH_PERF_DIAGNOSE_AFTER=$((after * 3 / 4)) $VLP perf $t $LPVM_HOST_IP --provider ibverbs -p $port $(stream_extra "$t") --json" $T_CASE) || rc=$?
    wait "$pid" || rc=$?
    kill "$watchdog" 2> /dev/null
    echo "$out"
    sed 's/^/[server] /' "$case_dir/soft.log"
    if [ "$rc" = 0 ] && stream_result_ok "$out" "rdma/ibverbs" && grep -q 'rdma/soft' "$case_dir/soft.log"; then
        note "$(stream_summary "$out"); server on rdma/soft"
        return 0
    fi
    note "rc=$rc: $(grep -m1 -E 'error|lightpath:' <<< "$out")"
    return 1
}

case_ibverbs_overhead() {
    [ -n "$IBV_OVERHEAD" ] || { note "NOT RUN: the overhead example was not built"; return $NOT_RUN; }
    local out rc=0
    out=$(lpvm_job ibv-overhead "/shared/bin/ibv-overhead rxe0 40 500" $T_CASE) || rc=$?
    echo "$out"
    echo "$out" >> "$results/ibverbs-perf.txt"
    note "$(grep -E '^  (wrapper|direct|difference)' <<< "$out" | sed 's/  */ /g; s/ (middle half[^)]*)//' | paste -sd';' -)"
    return $rc
}

# For a host process that should be done within $2 s (a case takes 1-5 s): if the process
# started as $1 (lpvm_ns_start's pid: `timeout`, with lightpath its child) still runs then,
# writes its threads' stacks (gdb, when installed) to $3 and, given $4, those of the lightpath
# processes in the VM (eu-stack, with their descriptors: eventfd counts, epoll members, TCP
# states) to $4, and copies the VM client's log $5 (host path) beside $4 as client.log, so a
# hang leaves more behind than a timeout.
stacks_if_stuck() {
    local top=$1 after=$2 file=$3 guest_file=${4:-} guest_log=${5:-} pid
    sleep "$after"
    kill -0 "$top" 2> /dev/null || return 0
    # The VM client's output so far (a stuck one's diagnostics), before a timeout ends it.
    [ -n "$guest_log" ] && [ -n "$guest_file" ] && cp "$guest_log" "$(dirname "$guest_file")/client.log" 2> /dev/null
    if [ -n "$guest_file" ] && lpvm_alive; then
        lpvm_job "stacks-$(basename "$(dirname "$guest_file")")" \
            'for p in $(pgrep -x lightpath); do echo "== pid $p"; eu-stack -p "$p" 2>&1 | head -n 600;
                echo "== fds of pid $p (eventfd counts, epoll members, sockets)";
                for f in /proc/$p/fdinfo/*; do n=${f##*/}; echo "-- fd $n -> $(readlink /proc/$p/fd/$n)";
                    grep -E "^(eventfd-count|tfd|pos)" "$f"; done; echo "== tcp of pid $p"; cat /proc/$p/net/tcp;
                done' 30 \
            > "$guest_file" 2>&1 || true
    fi
    command -v gdb > /dev/null || { echo "still running after ${after}s; no gdb for stacks" > "$file"; return 0; }
    for pid in "$top" $(pgrep -P "$top"); do
        [ "$(cat "/proc/$pid/comm" 2> /dev/null)" = lightpath ] || continue
        echo "== pid $pid, still running after ${after}s" >> "$file"
        gdb -p "$pid" -batch -ex "thread apply all bt 25" >> "$file" 2>&1 || true
    done
}

# Succeeds if the lightpath binary has `--provider ibverbs` for subcommand $1.
need_ibverbs() {
    need_lightpath "$1" || return 1
    if ! "$LP" "$1" --help 2>&1 | grep -q 'ibverbs'; then
        note "NOT RUN: lightpath $1 has no --provider ibverbs"
        return 1
    fi
}

# `lightpath devices` in the VM lists rxe0 with the GID the suite found by hand (index $G).
case_ibverbs_devices() {
    [ -n "$LP" ] || { note "NOT RUN: no lightpath binary"; return $NOT_RUN; }
    local out
    out=$(lpvm_job ibv-devices "$VLP devices" 30)
    echo "$out"
    local line
    line=$(grep -E '^ +rxe0 ' <<< "$out")
    note "$(sed 's/  */ /g' <<< "$line")"
    grep -q '^ibverbs: available$' <<< "$out" && grep -q "GID ::ffff:$LPVM_VM_IP " <<< "$line" &&
        grep -q "GID index $G (RoCE v2) chosen automatically" <<< "$line"
}

ibv_resources_before=""
case_ibverbs_conformance() {
    if [ -z "$IBV_TESTS" ]; then
        note "NOT RUN: no conformance binary (${ibv_tests_missing:-ibverbs-build-tests not selected})"
        return $NOT_RUN
    fi
    ibv_resources_before=$(lpvm_job ibv-res0 "rdma resource show rxe0" 30)
    local out rc=0
    # Linux 6.1's rxe reports two statuses the IBA names differently (LOC_QP_OP_ERR for an lkey
    # that names no region, REM_OP_ERR for a SEND longer than the receive buffer); the suite
    # accepts both variants, so no case is listed as a known deviation of rxe0.
    local known=
    out=$(lpvm_job ibv-conf "LIGHTPATH_IBV_REQUIRED=1 LIGHTPATH_IBV_LEAK_CHECK=1 LIGHTPATH_IBV_DEVICE=rxe0 LIGHTPATH_IBV_KNOWN_DEVIATIONS=$known /shared/bin/ibv-conformance" $T_CASE) || rc=$?
    echo "$out"
    note "$(grep -m1 '^test result' <<< "$out")$(grep -m1 -E '^(failures|known deviations)' <<< "$out" | sed 's/^/; /')"
    return $rc
}

# Lightpath pingpong on ibverbs against ibv_rc_pingpong, both on rxe0 in the VM. Lightpath is
# never given -g: it must find the RoCE v2 IPv4 GID itself.
case_ibverbs_pingpong() {
    local role=$1 s=$2 m=$3 port ev=""
    need_ibverbs pingpong || return $NOT_RUN
    take_port
    local c="ibv_rc_pingpong -d rxe0 -g $G -p $port -m $m -s $s -n $pp_iters -c"
    local l="$VLP pingpong --provider ibverbs -d rxe0 -p $port -m $m -s $s -n $pp_iters -c"
    case $role in
        server) lpvm_job "ibpp-$port" "lp_pair $port '$l' '$c $LPVM_VM_IP'" $T_CASE ;;
        client) lpvm_job "ibpp-$port" "lp_pair $port '$c' '$l $LPVM_VM_IP'" $T_CASE ;;
        events) lpvm_job "ibpp-$port" "lp_pair $port '$c -e' '$l -e $LPVM_VM_IP'" $T_CASE ;;
    esac
}

# Lightpath ibverbs (VM, rxe0) is the responder; Lightpath soft (host namespace) requests.
case_ibverbs_soft_ibv_server() {
    local op=$1 port host_rc=0 vm_rc=0 id
    need_ibverbs interop-peer || return $NOT_RUN
    take_port
    lp_traffic=$((lp_traffic + 1))
    id=ibvs-$op-$port
    lpvm_job_start "$id" "lp_serve $port $VLP interop-peer --provider ibverbs -d rxe0 -o $op -n $op_iters -m 1024 -p $port -t 60" $T_CASE
    if ! lpvm_job_wait_listening "$id" 30; then
        note "lightpath interop-peer (ibverbs) in the VM never listened on TCP $port"
        lpvm_job_wait "$id" 60
        cat "$LPVM_SHARE/jobs/$id.log"
        return 1
    fi
    lpvm_ns timeout --kill-after=3 $T_CASE "$LP" interop-peer --bind "$LPVM_HOST_IP" \
        -o "$op" -n "$op_iters" -m 1024 -p "$port" -t 60 "$LPVM_VM_IP" > "$case_dir/soft.log" 2>&1 || host_rc=$?
    lpvm_job_wait "$id" $((T_CASE + 30)) || vm_rc=$?
    cp "$LPVM_SHARE/jobs/$id.log" "$case_dir/ibverbs.log" 2> /dev/null
    sed 's/^/[ibverbs] /' "$case_dir/ibverbs.log"
    sed 's/^/[soft] /' "$case_dir/soft.log"
    [ "$vm_rc" = 0 ] && [ "$host_rc" = 0 ] && return 0
    note "ibverbs rc=$vm_rc, soft rc=$host_rc: $(grep -h -m1 'FAIL' "$case_dir/ibverbs.log" "$case_dir/soft.log" | head -n 1)"
    return 1
}

# Lightpath soft (host namespace) is the responder; Lightpath ibverbs (VM, rxe0) requests.
case_ibverbs_soft_soft_server() {
    local op=$1 port host_rc=0 vm_rc=0 pid
    need_ibverbs interop-peer || return $NOT_RUN
    take_port
    lp_traffic=$((lp_traffic + 1))
    lpvm_ns_start "$case_dir/soft.log" $T_CASE "$LP" interop-peer --bind "$LPVM_HOST_IP" \
        -o "$op" -n "$op_iters" -m 1024 -p "$port" -t 60
    pid=$LPVM_BG_PID
    if ! lpvm_ns_wait_listening "$port" 30; then
        note "lightpath interop-peer (soft) never listened on TCP $port"
        kill "$pid" 2> /dev/null
        return 1
    fi
    lpvm_job "ibvc-$op-$port" "$VLP interop-peer --provider ibverbs -d rxe0 -o $op -n $op_iters -m 1024 -p $port -t 60 $LPVM_HOST_IP" \
        $T_CASE > "$case_dir/ibverbs.log" 2>&1 || vm_rc=$?
    wait "$pid" || host_rc=$?
    sed 's/^/[ibverbs] /' "$case_dir/ibverbs.log"
    sed 's/^/[soft] /' "$case_dir/soft.log"
    [ "$vm_rc" = 0 ] && [ "$host_rc" = 0 ] && return 0
    note "ibverbs rc=$vm_rc, soft rc=$host_rc: $(grep -h -m1 'FAIL' "$case_dir/ibverbs.log" "$case_dir/soft.log" | head -n 1)"
    return 1
}

# `lightpath perf --provider ibverbs` and perftest's tool for the same test, same size and
# iterations, one run each, both on rxe0 in the VM; the numbers go to the note and perf.txt.
case_ibverbs_perf() {
    local t=$1 port lp_out pt_out size iters tool rc=0 pt_rc=0
    need_ibverbs perf || return $NOT_RUN
    case $t in
        *_lat) size=64 iters=2000 ;;
        *) size=65536 iters=2000 ;;
    esac
    tool=ib_${t}
    take_port
    lp_out=$(lpvm_job "ibperf-$t" "lp_pair $port '$VLP perf $t --provider ibverbs -d rxe0 -p $port -s $size -n $iters' '$VLP perf $t --provider ibverbs -d rxe0 -p $port -s $size -n $iters $LPVM_VM_IP'" $T_CASE) || rc=$?
    take_port
    # -F: perftest's CPU-frequency check fails under TCG ("Can't produce a report"); its own
    # failures are reported in the note but do not fail the case (it tests Lightpath).
    pt_out=$(lpvm_job "ptperf-$t" "lp_pair $port '$tool -F -d rxe0 -x $G -p $port -s $size -n $iters' '$tool -F -d rxe0 -x $G -p $port -s $size -n $iters $LPVM_VM_IP'" $T_CASE) || pt_rc=$?
    echo "== lightpath perf $t --provider ibverbs -s $size -n $iters"
    echo "$lp_out"
    echo "== $tool -F -s $size -n $iters"
    echo "$pt_out"
    {
        echo "== $t size $size iters $iters"
        grep -A3 -E '^\[client\] +(test|size|#bytes)' <<< "$lp_out" | grep -v '^--' | sed 's/^/lightpath /'
        grep -A1 -E '^\[client\] +#bytes' <<< "$pt_out" | sed 's/^/perftest  /'
    } >> "$results/ibverbs-perf.txt"
    note "one run each, numbers in $results/ibverbs-perf.txt$([ "$pt_rc" = 0 ] || echo " (perftest itself failed: rc=$pt_rc)")"
    return $rc
}

# Refused inputs: a bad device name, a GID index out of range, a region beyond the locked-memory
# limit (as an unprivileged user, whose RLIMIT_MEMLOCK applies), a remote access error (-x on
# write: a wrong rkey). Each must fail with a clear message and the right exit code, no crash.
case_ibverbs_bad_input() {
    need_ibverbs pingpong || return $NOT_RUN
    local port out fail=0
    out=$(lpvm_job ibv-bad1 "$VLP pingpong --provider ibverbs -d nosuch0 -n 1; echo rc=\$?" 30)
    echo "$out"
    grep -q 'no RDMA device named "nosuch0"; libibverbs lists: rxe0' <<< "$out" && grep -q '^rc=2$' <<< "$out" || { echo "bad device name: wrong outcome"; fail=1; }
    out=$(lpvm_job ibv-bad2 "$VLP pingpong --provider ibverbs -d rxe0 -g 4000 -n 1; echo rc=\$?" 30)
    echo "$out"
    grep -q 'GID index 4000 is out of range' <<< "$out" && grep -q '^rc=2$' <<< "$out" || { echo "GID index: wrong outcome"; fail=1; }
    out=$(lpvm_job ibv-bad3 "ulimit -l; setpriv --reuid=65534 --regid=65534 --clear-groups bash -c 'ulimit -l; $VLP pingpong --provider ibverbs -d rxe0 -s 67108864 -n 1 -p 1'; echo rc=\$?" 30)
    echo "$out"
    grep -q 'could not be pinned' <<< "$out" && grep -q '^rc=2$' <<< "$out" || { echo "region too large to pin: wrong outcome"; fail=1; }
    take_port
    local c="$VP -o write -n 2 -m 1024 -p $port -t 30"
    out=$(lpvm_job "ibv-bad4" "lp_pair $port '$c' '$VLP interop-peer --provider ibverbs -d rxe0 -o write -n 2 -m 1024 -p $port -t 30 -x $LPVM_VM_IP'" $T_CASE)
    echo "$out"
    grep -q '^server rc=1 client rc=1$' <<< "$out" || { echo "remote access error: both sides must FAIL with exit code 1"; fail=1; }
    [ "$fail" = 0 ] && note "bad device, GID index, pin limit and remote access error all refused cleanly"
    return $fail
}

# After every ibverbs case: no process holds rxe0 objects any more, the counts are back to
# what they were before (the conformance binary also checks after each of its cases).
case_ibverbs_no_leaks() {
    [ -n "$ibv_resources_before" ] || { note "NOT RUN: ibverbs-conformance did not record a baseline"; return $NOT_RUN; }
    local after
    after=$(lpvm_job ibv-res1 "rdma resource show rxe0" 30)
    echo "before: $ibv_resources_before"
    echo "after:  $after"
    note "rdma resource before: $ibv_resources_before; after: $after"
    [ "$after" = "$ibv_resources_before" ]
}

# Real rxe packets on the wire without Lightpath: verbs_peer (VM) talks to tools/oob_stub.py,
# which answers the TCP exchange but has no RDMA, so rxe sends WRITE FIRST/MIDDLE/LAST-with-
# immediate to the host and retransmits them until its retry count runs out (-R 2: rxe treats
# retry_cnt 7 as infinite), status "transport retry counter exceeded". The capture cases check those packets.
case_rxe_to_stub() {
    local port pid vm_rc=0 host_rc=0
    command -v python3 > /dev/null || { note "NOT RUN: python3 is not installed"; return $NOT_RUN; }
    take_port
    lpvm_ns_start "$case_dir/stub.log" 60 python3 "$interop/tools/oob_stub.py" --bind "$LPVM_HOST_IP" --port "$port"
    pid=$LPVM_BG_PID
    lpvm_ns_wait_listening "$port" 20 || { note "the stub never listened"; return 1; }
    lpvm_job "stub-$port" "$VP -o write_imm -s 2500 -n 1 -m 1024 -R 2 -p $port -t 30 $LPVM_HOST_IP" 60 \
        > "$case_dir/rxe.log" 2>&1 || vm_rc=$?
    wait "$pid" || host_rc=$?
    cat "$case_dir/rxe.log" "$case_dir/stub.log"
    rxe_traffic=1
    if [ "$vm_rc" = 1 ] && grep -q 'retry counter exceeded' "$case_dir/rxe.log" && [ "$host_rc" = 0 ]; then
        note "rxe sent its requests and gave up after its retries, as expected"
        return 0
    fi
    note "expected verbs_peer to fail with retry counter exceeded: rc=$vm_rc, stub rc=$host_rc"
    return 1
}

pcap="" rxe_traffic=0
# Our own ICRC check of every packet on the tap (interop/tools/pcap_roce.py), plus the vectors.
case_capture_independent() {
    if [ "$lp_traffic" = 0 ] && [ "$rxe_traffic" = 0 ] || [ ! -s "$pcap" ]; then
        note "NOT RUN: no case put RoCE traffic on the tap"
        return $NOT_RUN
    fi
    command -v python3 > /dev/null || { note "NOT RUN: python3 is not installed"; return $NOT_RUN; }
    local rc=0
    # One pass over the capture (gigabytes after the bandwidth cases) gives both the summary
    # and the JSON the verdict below and the decode case read.
    python3 "$interop/tools/pcap_roce.py" "$pcap" --json-out "$case_dir/icrc.json" \
        --vectors "$results/vectors" > "$case_dir/icrc.txt" || rc=$?
    cat "$case_dir/icrc.txt"
    python3 - "$case_dir/icrc.json" "$LPVM_HOST_IP" "$LPVM_VM_IP" "$lp_traffic" > "$case_dir/verdict" << 'EOF'
import json, sys
s = json.load(open(sys.argv[1]))
by = s["by_source"]
ours, rxe = by.get(sys.argv[2], {}).get("packets", 0), by.get(sys.argv[3], {}).get("packets", 0)
print(f"{s['packets']} packets ({ours} from Lightpath, {rxe} from rxe), {s['icrc_bad']} bad ICRCs")
# Lightpath packets are required once a Lightpath case ran; rxe packets always
sys.exit(0 if s["icrc_bad"] == 0 and rxe > 0 and (ours > 0 or sys.argv[4] == "0") else 1)
EOF
    local verdict_rc=$? dropped
    # MiB-sized READ bursts can outrun tcpdump; the packets it did keep are all checked
    dropped=$(awk '/packets dropped by kernel/ { print $1 }' "$pcap.tcpdump.log" 2> /dev/null)
    note "$(cat "$case_dir/verdict")${dropped:+ (tcpdump dropped $dropped)}; vectors in $results/vectors"
    [ "$rc" = 0 ] && [ "$verdict_rc" = 0 ]
}

# `lightpath decode --pcap FILE --json` must report a good ICRC for every packet, and see the
# same number of RoCE packets as the independent checker.
case_capture_decode() {
    if [ "$lp_traffic" = 0 ] && [ "$rxe_traffic" = 0 ] || [ ! -s "$pcap" ]; then
        note "NOT RUN: no case put RoCE traffic on the tap"
        return $NOT_RUN
    fi
    [ -n "$LP" ] || { note "NOT RUN: no lightpath binary"; return $NOT_RUN; }
    if ! "$LP" decode --help 2>&1 | grep -q -- '--pcap' || ! "$LP" decode --help 2>&1 | grep -q -- '--json'; then
        note "NOT RUN: lightpath decode has no --pcap/--json options yet"
        return $NOT_RUN
    fi
    command -v python3 > /dev/null || { note "NOT RUN: python3 is not installed"; return $NOT_RUN; }
    local decode_rc=0 check_rc=0 expected independent=$results/cases/capture-icrc-independent/icrc.json
    # The independent checker's count: from its case when that ran, else counted now.
    if [ ! -s "$independent" ]; then
        independent=$case_dir/icrc.json
        python3 "$interop/tools/pcap_roce.py" "$pcap" --json > "$independent"
    fi
    expected=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["packets"])' "$independent")
    # Piped, not written out first: the JSON of a whole run is gigabytes (4x slower through a
    # file). The first 200 lines are kept in decode-sample.json.
    "$LP" decode --pcap "$pcap" --json 2> "$case_dir/decode.stderr" \
        | python3 "$interop/tools/check_decode_json.py" - "$expected" --sample "$case_dir/decode-sample.json" \
            > "$case_dir/verdict"
    local codes=("${PIPESTATUS[@]}")
    decode_rc=${codes[0]} check_rc=${codes[1]}
    cat "$case_dir/verdict" "$case_dir/decode.stderr"
    note "$(tail -n 1 "$case_dir/verdict") (decode exit code $decode_rc)"
    [ "$decode_rc" = 0 ] && [ "$check_rc" = 0 ]
}

# ------------------------------------------------------------------------------ run
needs_vm=0 needs_lp=0
for c in "${selected[@]}"; do
    IFS='|' read -r id _ fn <<< "$c"
    case "$fn" in case_build_lightpath*) needs_lp=1 ;; case_build_*) ;; *) needs_vm=1 ;; esac
done

printf '  %-36s %-6s %7s  %s\n' CASE RESULT SECONDS NOTE
for c in "${selected[@]}"; do
    IFS='|' read -r id dir fn <<< "$c"
    [[ "$fn" == case_build_* ]] && run_case "$id" "$dir" $fn
done
# Without the build case selected, still use LIGHTPATH_BIN when given.
if [ "$needs_lp" = 0 ] && [ -n "${LIGHTPATH_BIN:-}" ] && [ -x "$LIGHTPATH_BIN" ]; then LP=$LIGHTPATH_BIN; fi

boot_seconds=n/a
if [ "$needs_vm" = 1 ]; then
    LPVM_MTU=9000 # RoCE MTU 4096 needs it; 256 and 1024 run on it too
    LPVM_SHARE=$results/share
    mkdir -p "$LPVM_SHARE/bin"
    cp "$LPVM_CACHE/bin/verbs_peer" "$LPVM_SHARE/bin/"
    lpvm_install_guest_helpers
    trap lpvm_cleanup EXIT
    trap 'exit 130' INT
    trap 'exit 143' TERM
    lpvm_net_up || skip "cannot create the namespace $LPVM_NETNS with its tap device"
    pcap=$results/capture.pcap
    lpvm_pcap_start "$pcap" || echo "interop: tcpdump did not start; the capture cases will not run"
    if ! lpvm_boot; then
        echo "interop: the VM did not boot; console: $LPVM_SHARE/console.log"
        tail -n 20 "$LPVM_SHARE/console.log" 2> /dev/null
        lpvm_cleanup
        exit 1
    fi
    boot_seconds=$LPVM_BOOT_SECONDS
    # The VM runs the host's binaries (same Debian release and glibc) from the share.
    [ -n "$LP" ] && cp "$LP" "$LPVM_SHARE/bin/lightpath"
    [ -n "$IBV_TESTS" ] && cp "$IBV_TESTS" "$LPVM_SHARE/bin/ibv-conformance"
    [ -n "$IBV_OVERHEAD" ] && cp "$IBV_OVERHEAD" "$LPVM_SHARE/bin/ibv-overhead"
    G=$(lpvm_job gid "lp_v4gid_index" 30) || { echo "interop: no IPv4-mapped GID in the VM"; exit 1; }
    echo "interop: VM up in ${boot_seconds}s (accel $LPVM_ACCEL, link MTU $LPVM_MTU, rxe GID index $G)"
    for c in "${selected[@]}"; do
        IFS='|' read -r id dir fn <<< "$c"
        case "$fn" in case_build_* | case_capture*) continue ;; esac
        if ! lpvm_alive; then
            record "$id" "$dir" FAIL 0 "the VM is gone (see $LPVM_SHARE/console.log)"
            continue
        fi
        if [ $((SECONDS - suite_start)) -gt "$deadline" ]; then
            record "$id" "$dir" FAIL 0 "not started: the suite passed its ${deadline}s deadline"
            continue
        fi
        retry_case=1 run_case "$id" "$dir" $fn
    done
    lpvm_job counters "grep -H . /sys/class/infiniband/rxe0/ports/1/hw_counters/* | sed 's|.*/||'" 30 \
        > "$results/rxe-counters.txt" 2>&1
    lpvm_job dmesg "dmesg" 30 > "$results/dmesg.txt" 2>&1
    lpvm_stop
    lpvm_pcap_stop
    for c in "${selected[@]}"; do
        IFS='|' read -r id dir fn <<< "$c"
        [[ "$fn" == case_capture* ]] && run_case "$id" "$dir" $fn
    done
    lpvm_cleanup
fi

total=$((SECONDS - suite_start))
{
    echo
    echo "Lightpath <-> rxe interop suite, $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    printf '%-36s  %-40s  %-7s  %7s  %s\n' CASE DIRECTION RESULT SECONDS NOTE
    while IFS=$'\t' read -r id dir result seconds text; do
        printf '%-36s  %-40s  %-7s  %7s  %s\n' "$id" "$dir" "$result" "$seconds" "$text"
    done < "$summary"
    echo
    echo "image ${image_seconds}s, VM boot ${boot_seconds}s, total ${total}s; results: $results"
} | tee "$results/summary.txt"
# CI shows only the end of the output: name each failure here, with the end of its log.
if [ "${#retried[@]}" -gt 0 ]; then
    echo "interop: passed on a retry (a flake to look into, not a failure):"
    printf '  %s\n' "${retried[@]}"
fi
if [ "$n_fail" != 0 ]; then
    echo "interop: failed:"
    while IFS=$'\t' read -r id _ result _ text; do
        [ "$result" = FAIL ] || continue
        echo "--- $id: $text"
        tail -n 12 "$results/cases/$id/case.log" 2> /dev/null | sed 's/^/    /'
    done < "$summary"
fi
echo "interop: $n_pass passed, $n_fail failed, $n_notrun skipped"
[ "$n_fail" = 0 ]
