#!/usr/bin/env bash
# One test over every message size (`--all`: 2 B to 8 MiB) on each provider in turn, server and
# client on loopback, drawn as one SVG chart with kernel TCP beside the RDMA providers
# (`lightpath plot`). The JSON lines stay beside the chart.
#
#   scripts/sweep.sh stream_lat                  # -> target/sweep-stream_lat.svg and .jsonl
#   scripts/sweep.sh write_bw out.svg            # a verbs test, chart where you want it
#   PROVIDERS="soft tcp" scripts/sweep.sh stream_bw
#   EXTRA=--polling scripts/sweep.sh stream_lat  # options for both sides
#   ITERS=100 scripts/sweep.sh stream_lat        # -n for every size (default: perf's budget)
#   B=path/to/lightpath scripts/sweep.sh ...     # a binary already built
set -euo pipefail
cd "$(dirname "$0")/.."
test=${1:?usage: scripts/sweep.sh TEST [OUT.svg]}
out=${2:-target/sweep-$test.svg}
if [ -z "${B:-}" ]; then
    cargo build --release -q -p lightpath-cli
    B=${CARGO_TARGET_DIR:-target}/release/lightpath
fi
PROVIDERS=${PROVIDERS:-soft shm tcp}
read -r -a extra <<< "${EXTRA:-}"
iters=()
[ -n "${ITERS:-}" ] && iters=(-n "$ITERS")
jsonl=${out%.svg}.jsonl
mkdir -p "$(dirname "$out")"
: > "$jsonl"
# Below the kernel's ephemeral range (32768-60999 by default): a port some client connection
# was given could not be listened on.
port=$((20000 + RANDOM % 10000))
for provider in $PROVIDERS; do
    port=$((port + 1))
    args=(--provider "$provider" -p "$port" "${extra[@]}")
    # The verbs tests' soft devices use their own UDP port, away from any stream device on 4791.
    if [ "$provider" = soft ] && [[ $test != stream_* ]]; then args+=(--udp-port 5811); fi
    "$B" perf "$test" "${args[@]}" > /dev/null 2> "$jsonl.server.log" &
    server=$!
    sleep 0.2
    echo "sweep: $test over $provider" >&2
    if "$B" perf "$test" 127.0.0.1 "${args[@]}" --all "${iters[@]}" --json >> "$jsonl"; then
        wait "$server" || true
    else
        echo "sweep: $test over $provider failed" >&2
        sed 's/^/  server: /' "$jsonl.server.log" >&2
        kill "$server" 2> /dev/null || true
        wait "$server" 2> /dev/null || true
    fi
done
rm -f "$jsonl.server.log"
"$B" plot "$jsonl" --test "$test" -o "$out"
