#!/usr/bin/env bash
# Runs one `lightpath perf stream_rr` configuration many times, each under a timeout, and counts
# the runs that did not finish: the check for lost wake-ups after a change to a driver (a rare
# hang shows as one run in tens or hundreds). The first hung run's state is kept: both
# processes' thread stacks (gdb, when installed) and their soft devices' counters
# (`lightpath devices --stats`), in $KEEP (default target/hang_check/); so are the first failed
# run's logs (failed_client.log, failed_server.log).
#
#   scripts/hang_check.sh                                  # 100 runs: soft, 16 conns, event-loop server
#   RUNS=300 PROVIDER=shm SHAPE=threads scripts/hang_check.sh
#   CONNS=100 ITERS=200 scripts/hang_check.sh
#   B=path/to/lightpath scripts/hang_check.sh              # a binary already built
#
# Exit status: 0 when every run finished, 1 otherwise.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -z "${B:-}" ]; then
    cargo build --release -q -p lightpath-cli || exit 2
    B=${CARGO_TARGET_DIR:-target}/release/lightpath
fi
B=$(realpath "$B")
RUNS=${RUNS:-100}
PROVIDER=${PROVIDER:-soft}
CONNS=${CONNS:-16}
ITERS=${ITERS:-1250}
SHAPE=${SHAPE:-loop}
LIMIT=${LIMIT:-15}
KEEP=${KEEP:-target/hang_check}
mkdir -p "$KEEP"

hung=0
failed=0
# A server on a free port below the kernel's ephemeral range (a port the kernel had just given
# to some connection made the server fail, or the client connect to itself), once it listens.
start_server() {
    local tries
    for tries in $(seq 10); do
        port=$((10000 + RANDOM % 22000))
        "$B" perf stream_rr --provider "$PROVIDER" -p "$port" --server "$SHAPE" > /dev/null 2> "$KEEP/server.log" &
        server=$!
        for _ in $(seq 50); do
            grep -q "waiting for a client" "$KEEP/server.log" 2> /dev/null && return 0
            kill -0 "$server" 2> /dev/null || break
            sleep 0.1
        done
        kill "$server" 2> /dev/null
        wait "$server" 2> /dev/null
    done
    echo "hang_check: no server would start: $(tail -1 "$KEEP/server.log")" >&2
    exit 2
}

for run in $(seq "$RUNS"); do
    start_server
    "$B" perf stream_rr 127.0.0.1 --provider "$PROVIDER" -p "$port" -s 64 -n "$ITERS" --conns "$CONNS" \
        --server "$SHAPE" --json > /dev/null 2> "$KEEP/client.log" &
    client=$!
    waited=0
    while kill -0 "$client" 2> /dev/null && [ "$waited" -lt $((LIMIT * 10)) ]; do
        sleep 0.1
        waited=$((waited + 1))
    done
    if kill -0 "$client" 2> /dev/null; then
        hung=$((hung + 1))
        echo "hang_check: run $run did not finish within ${LIMIT}s" >&2
        if [ "$hung" = 1 ]; then
            "$B" devices --stats > "$KEEP/stats.txt" 2>&1 || true
            if command -v gdb > /dev/null; then
                gdb -p "$client" -batch -ex "thread apply all bt 20" > "$KEEP/client_stacks.txt" 2>&1 || true
                gdb -p "$server" -batch -ex "thread apply all bt 20" > "$KEEP/server_stacks.txt" 2>&1 || true
            fi
            cp "$KEEP/client.log" "$KEEP/hung_client.log"
            cp "$KEEP/server.log" "$KEEP/hung_server.log"
        fi
        kill "$client" 2> /dev/null
    elif ! wait "$client"; then
        failed=$((failed + 1))
        echo "hang_check: run $run failed: $(tail -1 "$KEEP/client.log")" >&2
        if [ "$failed" = 1 ]; then
            cp "$KEEP/client.log" "$KEEP/failed_client.log"
            cp "$KEEP/server.log" "$KEEP/failed_server.log"
        fi
    fi
    kill "$server" 2> /dev/null
    wait 2> /dev/null
done
echo "hang_check: $PROVIDER x$CONNS ($SHAPE server, $ITERS requests each): $hung of $RUNS runs hung, $failed failed"
if [ "$hung" -gt 0 ]; then
    echo "hang_check: the first hung run's stacks and counters are in $KEEP/" >&2
fi
[ "$hung" = 0 ] && [ "$failed" = 0 ]
