#!/usr/bin/env bash
# What Lightpath's tracing costs when it is off (issue 16: "off the hot path when disabled"):
# the release CLI as users get it against the same source built with every tracing call
# compiled out (`--features no-tracing`, in target/no-tracing), the rows of scripts/compare.sh
# that exercise the soft provider's and the streams' hot paths, run alternately with the two
# binaries on loopback with default options and LIGHTPATH_LOG unset. Prints, per row, the
# values of each round and the ratio of the medians (with tracing / without).
#
#   scripts/tracing_overhead.sh             # 3 rounds
#   ROUNDS=5 scripts/tracing_overhead.sh
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${ROUNDS:-3}
cargo build --release -q -p lightpath-cli
cargo build --release -q -p lightpath-cli --features no-tracing --target-dir target/no-tracing
WITH=$(realpath target/release/lightpath)
WITHOUT=$(realpath target/no-tracing/release/lightpath)
OUT=${OUT:-target/tracing_overhead.jsonl}
: > "$OUT"
unset LIGHTPATH_LOG
# Below the kernel's ephemeral range (32768-60999 by default): a port some client connection
# was given could not be listened on.
port=$((20000 + RANDOM % 10000))

# row BIN NAME TEST SIZE ITERS [args]: one server and one client run; appends a JSON line.
row() {
    local bin=$1 name=$2 test=$3 size=$4 iters=$5
    shift 5
    port=$((port + 1))
    local extra=()
    # The verbs tests' soft devices use their own UDP port, as in compare.sh.
    [[ $test == stream_* ]] || extra=(--udp-port $((5800 + port % 100)))
    "$bin" perf "$test" --provider soft -p "$port" "${extra[@]}" "$@" > /dev/null 2>&1 &
    local server=$!
    sleep 0.2
    local line
    if line=$(timeout 120 "$bin" perf "$test" 127.0.0.1 --provider soft -p "$port" -s "$size" -n "$iters" \
        --json "${extra[@]}" "$@" 2> /dev/null | tail -n 1); then
        local which=with
        [ "$bin" = "$WITHOUT" ] && which=without
        echo "{\"row\":\"$name\",\"build\":\"$which\",\"result\":$line}" >> "$OUT"
    else
        echo "tracing_overhead: $name failed with $bin" >&2
    fi
    wait "$server" 2> /dev/null || true
}

for round in $(seq "$ROUNDS"); do
    echo "round $round of $ROUNDS" >&2
    for bin in "$WITH" "$WITHOUT"; do
        row "$bin" "send_lat 8 B" send_lat 8 20000
        row "$bin" "write_bw 64 KiB" write_bw 65536 20000
        row "$bin" "stream_lat 8 B" stream_lat 8 20000
        row "$bin" "stream_bw 64 KiB" stream_bw 65536 20000
        row "$bin" "stream_rr x16 (loop)" stream_rr 64 1250 --conns 16 --server loop
    done
done

python3 - "$OUT" <<'PY'
import json, statistics, sys
rows = {}
for line in open(sys.argv[1]):
    d = json.loads(line)
    r = d["result"]
    if d["row"].startswith("stream_rr"):
        value, unit = r["msg_rate_mpps"] * 1000, "kreq/s"
    elif "lat_us" in r and "bw_mb_s" not in r:
        value, unit = r["lat_us"]["median"], "us"
    else:
        value, unit = r["bw_mb_s"], "MB/s"
    rows.setdefault(d["row"], {"unit": unit, "with": [], "without": []})[d["build"]].append(value)
print(f"{'row':22} {'unit':7} {'with tracing (per round)':32} {'compiled out (per round)':32} with/without")
for name, r in rows.items():
    fmt = lambda xs: " ".join(f"{x:.2f}" for x in xs)
    ratio = statistics.median(r["with"]) / statistics.median(r["without"])
    print(f"{name:22} {r['unit']:7} {fmt(r['with']):32} {fmt(r['without']):32} {ratio:.3f}")
PY
