#!/usr/bin/env bash
# Side-by-side numbers of every transport on this machine, in one run: each row runs the same
# test over each provider back to back (server and client on loopback), so ratios compare runs
# taken seconds apart. Prints a table; the raw JSON lines go to $OUT (default
# target/compare.jsonl).
#
#   scripts/compare.sh                 # verbs and stream tests over soft, shm and tcp
#   ROUNDS=5 scripts/compare.sh        # every row five times; the table shows the median
#   ONLY=stream scripts/compare.sh     # only the stream_* rows (or ONLY=verbs)
#   B=path/to/lightpath scripts/compare.sh   # a binary already built
#
# Latency is one-way (round trip / 2), the median of the run; bandwidth in MB/s. Everything
# busy-polls, as the verbs tests always do: the stream tests run with `--polling` (soft drives
# its device from the calling thread; every transport spins before sleeping).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${B:-}" ]; then
    cargo build --release -q -p lightpath-cli
    B=${CARGO_TARGET_DIR:-target}/release/lightpath
fi
OUT=${OUT:-target/compare.jsonl}
ROUNDS=${ROUNDS:-1}
ONLY=${ONLY:-all}
: > "$OUT"
port=$((20000 + RANDOM % 20000))

# run TEST SIZE PROVIDER ITERS [extra client/server args]
run() {
    local test=$1 size=$2 provider=$3 iters=$4
    shift 4
    port=$((port + 1))
    # The verbs tests' soft devices use their own UDP port, away from any stream device on 4791.
    if [ "$provider" = soft ] && [[ $test != stream_* ]]; then set -- --udp-port 5811 "$@"; fi
    "$B" perf "$test" --provider "$provider" -p "$port" "$@" > /dev/null 2>&1 &
    local server=$!
    sleep 0.3
    "$B" perf "$test" 127.0.0.1 --provider "$provider" -p "$port" -s "$size" -n "$iters" --json "$@" >> "$OUT" ||
        echo "compare: $test $size over $provider failed" >&2
    wait "$server" || true
}

for _ in $(seq "$ROUNDS"); do
    if [ "$ONLY" != stream ]; then
        for t in send_lat write_lat read_lat; do
            for p in soft shm tcp; do run $t 8 $p 5000; done
        done
        for p in soft shm tcp; do run send_lat 4096 $p 5000; done
        for t in send_bw write_bw read_bw; do
            for s in 65536 1048576; do
                n=$((s == 65536 ? 5000 : 1000))
                for p in soft shm tcp; do run $t $s $p $n; done
            done
        done
    fi
    if [ "$ONLY" != verbs ]; then
        for s in 8 4096; do
            for p in soft shm tcp; do run stream_lat $s $p 5000 --polling; done
        done
        for s in 65536 1048576; do
            n=$((s == 65536 ? 5000 : 1000))
            for p in soft shm tcp; do run stream_bw $s $p $n --polling; done
        done
    fi
done

python3 - "$OUT" <<'EOF'
import json, statistics, sys
rows = {}
for line in open(sys.argv[1]):
    r = json.loads(line)
    value = r["lat_us"]["median"] if "lat_us" in r else r.get("bw_mb_s")
    if value is None:
        continue
    rows.setdefault((r["test"], r["size"]), {}).setdefault(r["provider"], []).append(value)
print(f"{'test':<12}{'size':>9}{'soft':>12}{'shm':>12}{'tcp':>12}{'soft/tcp':>10}{'shm/tcp':>10}")
for (test, size), by in rows.items():
    med = {p: statistics.median(v) for p, v in by.items()}
    unit = "us" if test.endswith("lat") else "MB/s"
    cell = lambda p: f"{med[p]:.2f}" if p in med and unit == "us" else (f"{med[p]:.0f}" if p in med else "-")
    ratio = lambda p: f"{med[p] / med['tcp']:.2f}" if p in med and med.get("tcp") else "-"
    print(f"{test:<12}{size:>9}{cell('soft'):>12}{cell('shm'):>12}{cell('tcp'):>12}{ratio('soft'):>10}{ratio('shm'):>10}  {unit}")
EOF
