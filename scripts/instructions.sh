#!/usr/bin/env bash
# Instructions per operation, counted by valgrind's callgrind: a measure of Lightpath's own CPU
# work that the noise of a shared 2-core VM does not move (wall-clock ratios here swing 2-3x
# with the host's CPU placement; docs/architecture.md). One side of a `lightpath perf` test
# runs under callgrind at two iteration counts; the difference, divided by the operations
# between them, is its user-space instructions per operation (set-up and teardown cancel out).
# Then, per operation and per call, the inclusive counts of the functions named in FUNCS.
#
#   scripts/instructions.sh                          # soft stream_rr, 16 conns, event-loop server
#   SERVER=threads PROVIDER=shm scripts/instructions.sh   # a thread per connection instead
#   PROVIDER=shm scripts/instructions.sh
#   TEST=stream_bw SIZE=64K NETNS=1 SIDE=client scripts/instructions.sh   # bulk, sender side,
#                                                    # between two namespaces (root)
#   FUNCS="Engine::handle_packet|Qp::produce" scripts/instructions.sh
#   B=/tmp/old/lightpath scripts/instructions.sh     # another build (made with the RUSTFLAGS below)
#
# Counts are of user space only (the kernel's part of a system call is not seen). The total
# per operation moves by up to ~20% between runs of one build, because how many operations a
# wake-up finds (batching) depends on timing, and the traced side runs ~50x slower than its
# peer; per-call counts of one function are steady to a few percent within one build. Inlining
# decides which functions show up at all and what their counts include (a function inlined
# into its caller reports no calls), so across builds compare totals over several runs each,
# and per-function counts only where both builds list the function the same way.
#
# The build: release with `--cfg rustix_use_libc` into target-cg (rustix's own vDSO lookup
# reads the auxiliary vector in a way valgrind does not emulate, and the process dies with
# SIGSEGV in `check_elf_base`); spinning waits are turned off (LIGHTPATH_SOFT_SPIN_US=0,
# --spin-us 0), since a spin's count is its duration.
set -euo pipefail
cd "$(dirname "$0")/.."
command -v valgrind > /dev/null || { echo "instructions.sh: needs valgrind" >&2; exit 1; }
PROVIDER=${PROVIDER:-soft}
TEST=${TEST:-stream_rr}
SIDE=${SIDE:-server}
SERVER=${SERVER:-loop} # stream_rr's server shape: loop (one event loop) or threads
NETNS=${NETNS:-0}
CONNS=${CONNS:-16}
if [ "$TEST" = stream_rr ]; then
    SIZE=${SIZE:-64}
    N1=${N1:-300}
    N2=${N2:-1300}
    PER_ITER=$CONNS # stream_rr's -n counts requests per connection
    EXTRA=(--server "$SERVER" --conns "$CONNS" --spin-us 0)
else
    SIZE=${SIZE:-64K}
    N1=${N1:-1000}
    N2=${N2:-3000}
    PER_ITER=1
    EXTRA=()
fi
FUNCS=${FUNCS:-"AsyncRead>::poll_read|AsyncWrite>::poll_write|RdmaConn<D>::pump|RdmaConn<D>::post_ops|QueuePair>::post_send|Engine::handle_packet|Engine::poll_transmit|Qp::produce|TxBuffers::fill|RxBuffers::deliver_received"}

if [ -z "${B:-}" ]; then
    RUSTFLAGS="--cfg rustix_use_libc" CARGO_TARGET_DIR=target-cg cargo build --release -q -p lightpath-cli
    B=target-cg/release/lightpath
fi
B=$(realpath "$B")
OUTDIR=$(mktemp -d /tmp/lp-instr.XXXXXX)
export LIGHTPATH_SOFT_SPIN_US=0

SERVER_AT=127.0.0.1
run_server=()
run_client=()
if [ "$NETNS" = 1 ]; then
    [ "$(id -u)" = 0 ] || { echo "instructions.sh: NETNS=1 needs root" >&2; exit 1; }
    NS_A=lpi-a-$$ NS_B=lpi-b-$$ NS_VETH=lpi NS_NET=10.79.0
    # shellcheck source=scripts/netns.sh
    . scripts/netns.sh
    trap netns_down EXIT
    netns_up
    SERVER_AT=$NS_NET.1
    run_server=(ip netns exec "$NS_A")
    run_client=(ip netns exec "$NS_B")
fi

# Runs one test with the chosen side under callgrind; prints its total instruction count.
measure() {
    local n=$1 port=$2 out=$OUTDIR/cg.$1
    local server=("${run_server[@]}" timeout 600) client=("${run_client[@]}" timeout 600)
    local grind=(valgrind --tool=callgrind --callgrind-out-file="$out")
    if [ "$SIDE" = server ]; then server+=("${grind[@]}"); else client+=("${grind[@]}"); fi
    local bind=()
    [ "$NETNS" = 1 ] && bind=(--bind "$SERVER_AT")
    "${server[@]}" "$B" perf "$TEST" --provider "$PROVIDER" -s "$SIZE" -n "$n" -p "$port" \
        "${bind[@]}" "${EXTRA[@]}" > "$OUTDIR/server.$n" 2>&1 &
    local pid=$!
    # The server must listen before the client connects (slower under callgrind).
    for _ in $(seq 100); do
        grep -q "waiting for a client" "$OUTDIR/server.$n" 2> /dev/null && break
        sleep 0.1
    done
    "${client[@]}" "$B" perf "$TEST" --provider "$PROVIDER" -s "$SIZE" -n "$n" -p "$port" \
        "${EXTRA[@]}" "$SERVER_AT" > "$OUTDIR/client.$n" 2>&1
    wait "$pid"
    callgrind_annotate "$out" 2> /dev/null | awk '/PROGRAM TOTALS/ && !done {gsub(",", "", $1); print $1; done = 1}'
}

port=$((20000 + $$ % 10000))
t1=$(measure "$N1" "$port")
t2=$(measure "$N2" $((port + 1)))
ops=$(((N2 - N1) * PER_ITER))
echo "# $TEST over $PROVIDER, ${SIZE} B, $SIDE side under callgrind$([ "$NETNS" = 1 ] && echo ', between namespaces')"
echo "# $N1 and $N2 iterations: $t1 and $t2 instructions; $ops operations between them"
printf "instructions per operation: %d\n" $(((t2 - t1) / ops))
echo "# per function (the $N2-iteration run): inclusive instructions per operation, calls per operation, per call"
callgrind_annotate --inclusive=yes --tree=both "$OUTDIR/cg.$N2" 2> /dev/null > "$OUTDIR/tree"
total_ops=$((N2 * PER_ITER))
IFS='|' read -ra names <<< "$FUNCS"
for f in "${names[@]}"; do
    awk -v f="$f" -v ops="$total_ops" '
        # the function itself (the largest entry, if inlining split it over several files)
        index($0, "*  ") && index($0, f " [") { v = $1; gsub(",", "", v); if (v + 0 > incl) incl = v + 0; next }
        # every call of it, as the callee lines of its callers: "> file:name (Nx)"
        index($0, ">   ") && index($0, f " (") { c = $0; sub(/.*\(/, "", c); sub(/x\).*/, "", c); gsub(",", "", c); calls += c }
        END { if (incl > 0) printf "%-45s %8.0f %6.2f %8.0f\n", f, incl / ops, calls / ops, (calls > 0 ? incl / calls : 0) }
    ' "$OUTDIR/tree"
done
echo "# raw files: $OUTDIR"
