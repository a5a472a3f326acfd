#!/usr/bin/env bash
# hyper HTTP/1.1 over Lightpath beside TCP (issue 17): requests/s, median and p99 latency and
# CPU per request, for 1, 8 and 64 keep-alive connections and bodies of 100 B and 64 KiB, over
# shm, soft, Lightpath's TCP fallback (`tcp`) and plain tokio TCP sockets (`tokio-tcp`, no
# Lightpath code: the baseline an application has without Lightpath). Each cell runs every
# provider back to back (a fresh server process, then the client process; both on 127.0.0.1),
# so ratios compare runs taken seconds apart. Prints two tables (medians over the rounds); the
# raw JSON lines go to $OUT (default target/hyper_bench.jsonl).
#
#   scripts/hyper_bench.sh                          # 3 rounds (about 2 minutes)
#   ROUNDS=1 scripts/hyper_bench.sh                 # one round
#   PROVIDERS="shm tcp" CONNS="8" scripts/hyper_bench.sh
#   SMALL=8000 LARGE=4000 scripts/hyper_bench.sh    # measured requests per cell (all connections)
#   B=path/to/hyper_bench scripts/hyper_bench.sh    # a binary already built
#
# Each connection sends SMALL/conns (or LARGE/conns; at least 20) measured requests after a
# tenth as many warm-up requests (see crates/lightpath/examples/hyper_bench.rs).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${B:-}" ]; then
    cargo build --release -q -p lightpath --features tokio --example hyper_bench
    B=${CARGO_TARGET_DIR:-target}/release/examples/hyper_bench
fi
B=$(realpath "$B")
OUT=${OUT:-target/hyper_bench.jsonl}
ROUNDS=${ROUNDS:-3}
PROVIDERS=${PROVIDERS:-shm soft tcp tokio-tcp}
CONNS=${CONNS:-1 8 64}
BODIES=${BODIES:-100 65536}
SMALL=${SMALL:-8000}
LARGE=${LARGE:-4000}
mkdir -p "$(dirname "$OUT")"
: > "$OUT"
# Below the kernel's ephemeral range (32768-60999 by default): a port some client connection
# was given could not be listened on.
port=$((20000 + RANDOM % 10000))
failures=0
log=$OUT.server.log

# shellcheck source=scripts/stop.sh
. scripts/stop.sh

# attempt PROVIDER CONNS BODY REQUESTS: one server process, one client run; fails if either did.
attempt() {
    local provider=$1 conns=$2 body=$3 requests=$4
    port=$((port + 1))
    "$B" server "127.0.0.1:$port" --provider "$provider" > "$log" 2>&1 &
    local server=$!
    # Wait until it listens (it prints its address); a loaded machine may take seconds.
    for _ in $(seq 400); do
        grep -q "server on" "$log" 2> /dev/null && break
        if ! kill -0 "$server" 2> /dev/null; then
            local status=0
            wait "$server" || status=$?
            echo "hyper_bench: the $provider server on port $port exited ($status) before listening" >&2
            sed 's/^/  server: /' "$log" >&2
            return 1
        fi
        sleep 0.05
    done
    local ok=0
    timeout 150 "$B" client "127.0.0.1:$port" --provider "$provider" --conns "$conns" \
        --requests "$requests" --body "$body" --timeout 120 --json > "$OUT.line" || ok=$?
    stop "$server"
    # Anything the server said beyond its address is worth seeing (its connections' errors).
    grep -v "server on" "$log" | sort | uniq -c | sed "s/^/  $provider x$conns $body B server: /" >&2 || true
    [ "$ok" = 0 ] && cat "$OUT.line" >> "$OUT"
    return "$ok"
}

# run PROVIDER CONNS BODY: one attempt, and a second one should it fail.
run() {
    local provider=$1 conns=$2 body=$3
    local total=$SMALL
    [ "$body" -gt 4096 ] && total=$LARGE
    local requests=$((total / conns))
    [ "$requests" -lt 20 ] && requests=20
    if ! attempt "$provider" "$conns" "$body" "$requests"; then
        echo "hyper_bench: $provider, $conns connections, body $body failed; once more" >&2
        failures=$((failures + 1))
        attempt "$provider" "$conns" "$body" "$requests" || echo "hyper_bench: failed again" >&2
    fi
}

for round in $(seq "$ROUNDS"); do
    echo "round $round of $ROUNDS" >&2
    for conns in $CONNS; do
        for body in $BODIES; do
            for provider in $PROVIDERS; do run "$provider" "$conns" "$body"; done
        done
    done
done
rm -f "$log" "$OUT.line"

python3 - "$OUT" "$PROVIDERS" <<'EOF'
import json, statistics, sys
providers = sys.argv[2].split()
cells = {}
for line in open(sys.argv[1]):
    r = json.loads(line)
    cell = cells.setdefault((r["conns"], r["body"]), {}).setdefault(r["provider"], [])
    cell.append(r)

def med(runs, get):
    return statistics.median(get(r) for r in runs)

def size(body):
    return f"{body // 1024} KiB" if body >= 1024 and body % 1024 == 0 else f"{body} B"

short = {"tokio-tcp": "tokio"}
ratios = [(a, b) for b in ("tcp", "tokio-tcp") if b in providers for a in ("shm", "soft") if a in providers]
print(f"\nrequests/s (all connections), medians of {max(len(v) for c in cells.values() for v in c.values())} rounds")
head = f"{'conns':>5} {'body':>7}" + "".join(f"{p:>10}" for p in providers)
head += "".join(f"{a + '/' + short.get(b, b):>11}" for a, b in ratios)
print(head)
for (conns, body), by in sorted(cells.items()):
    rate = {p: med(by[p], lambda r: r["req_per_s"]) for p in providers if p in by}
    row = f"{conns:>5} {size(body):>7}" + "".join(f"{rate[p]:>10.0f}" if p in rate else f"{'-':>10}" for p in providers)
    row += "".join(f"{rate[a] / rate[b]:>11.2f}" if a in rate and b in rate else f"{'-':>11}" for a, b in ratios)
    print(row)

print("\nlatency per request in µs, median / p99 (medians over the rounds); CPU µs per request, client + server")
head = f"{'conns':>5} {'body':>7}" + "".join(f"{p + ' lat':>18}" for p in providers) + "   |" + "".join(f"{p:>10}" for p in providers)
print(head)
for (conns, body), by in sorted(cells.items()):
    row = f"{conns:>5} {size(body):>7}"
    for p in providers:
        if p in by:
            lat = f"{med(by[p], lambda r: r['lat_us']['median']):.0f} / {med(by[p], lambda r: r['lat_us']['p99']):.0f}"
        else:
            lat = "-"
        row += f"{lat:>18}"
    row += "   |"
    for p in providers:
        cpu = med(by[p], lambda r: r["cpu_us_per_req"] + r["server_cpu_us_per_req"]) if p in by else None
        row += f"{cpu:>10.1f}" if cpu is not None else f"{'-':>10}"
    print(row)
EOF
if [ "$failures" -gt 0 ]; then
    echo "hyper_bench: $failures runs failed (see above; each was tried once more)" >&2
    exit 1
fi
