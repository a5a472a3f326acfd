#!/usr/bin/env bash
# Connection set-up as short-lived programs see it (issues 12 and 15), beside kernel TCP. Two
# measures per provider, each the median of RUNS runs; the providers take turns run by run, so
# their ratios compare runs taken seconds apart:
#
#   cold    a fresh server process and a fresh client process per run, one connection each
#           (`lightpath perf stream_rr --conns 1 -n 1`): the client's `setup_per_s` (connect,
#           negotiation, the server's accept and its answer to the opening message) when
#           neither process has connected before: devices are opened on both sides.
#   client  one echo server for the whole run (crates/lightpath/examples/echo.rs) and fresh
#           client processes one after another, each connecting once, writing a line and reading
#           it back, then exiting (what `curl` or `redis-cli` against a running server does):
#           wall time and CPU time (user + system) of each client process, start to exit.
#
# `tcp` is the same programs with RDMA turned off (`LIGHTPATH_PROVIDERS=tcp`: the data goes over
# the kernel TCP connection, which is what the program costs without Lightpath). Steady-state
# set-up (many connections from one process) is `scripts/scale.sh`'s.
#
#   scripts/connect_bench.sh                       # shm soft tcp on loopback, 15 runs each
#   RUNS=31 PROVIDERS="soft tcp" scripts/connect_bench.sh
#   NETNS=1 scripts/connect_bench.sh               # also between two network namespaces over a
#                                                  # veth pair (root; soft and tcp)
#   B=path/to/lightpath E=path/to/echo scripts/connect_bench.sh   # binaries already built
#
# The raw measurements go to $OUT (default target/connect_bench.jsonl), one JSON line per run.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${B:-}" ] || [ -z "${E:-}" ]; then
    cargo build --release -q -p lightpath-cli
    cargo build --release -q -p lightpath --example echo
    B=${B:-${CARGO_TARGET_DIR:-target}/release/lightpath}
    E=${E:-${CARGO_TARGET_DIR:-target}/release/examples/echo}
fi
B=$(realpath "$B")
E=$(realpath "$E")
RUNS=${RUNS:-15}
PROVIDERS=${PROVIDERS:-shm soft tcp}
NETNS=${NETNS:-0}
OUT=${OUT:-target/connect_bench.jsonl}
mkdir -p "$(dirname "$OUT")"
: > "$OUT"
work=$(mktemp -d)
cleanup() { rm -rf "$work"; }
trap cleanup EXIT
# Below the kernel's ephemeral range (32768-60999 by default).
port=$((20000 + RANDOM % 10000))

# Where the processes run: loopback, or server in NS_A and clients in NS_B.
server_prefix=()
client_prefix=()
server_addr=127.0.0.1
place=loopback

# shellcheck source=scripts/stop.sh
. scripts/stop.sh

# wait_for TEXT LOG PID: until the server's log says TEXT (it listens then); fails if it exited.
wait_for() {
    for _ in $(seq 400); do
        grep -q "$1" "$2" 2> /dev/null && return 0
        kill -0 "$3" 2> /dev/null || { sed 's/^/  server: /' "$2" >&2; return 1; }
        sleep 0.01
    done
    echo "connect_bench: the server did not listen in time" >&2
    return 1
}

# cold PROVIDER: one fresh server, one fresh one-connection client; appends a JSON line.
cold() {
    local provider=$1 log=$work/cold.log
    port=$((port + 1))
    "${server_prefix[@]}" "$B" perf stream_rr --provider "$provider" -p "$port" --bind "$server_addr" \
        --server loop > /dev/null 2> "$log" &
    local server=$!
    wait_for "waiting for a client" "$log" "$server" || { stop "$server"; return 1; }
    local line
    line=$("${client_prefix[@]}" timeout 60 "$B" perf stream_rr "$server_addr" --provider "$provider" \
        -p "$port" --server loop -s 64 -n 1 --conns 1 --json) || { stop "$server"; return 1; }
    wait "$server" 2> /dev/null || true
    python3 -c 'import json, sys
r = json.loads(sys.argv[1])
print(json.dumps({"measure": "cold", "place": sys.argv[2], "provider": sys.argv[3],
                  "transport": r["transport"], "setup_per_s": r["setup_per_s"]}))' \
        "$line" "$place" "$provider" >> "$OUT"
}

# client PROVIDER ADDR: one client process of the echo server at ADDR (up for the provider's
# whole round: see `round`); prints a JSON line.
client() {
    local provider=$1 addr=$2
    python3 - "$provider" "$place" "$E" "$addr" "${client_prefix[@]}" <<'EOF'
import json, os, subprocess, sys, time
provider, place, echo, addr, prefix = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5:]
env = dict(os.environ, LIGHTPATH_PROVIDERS=provider)
started = time.perf_counter()
child = subprocess.Popen(prefix + [echo, "client", addr, "hello"], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
out = child.stdout.read().decode(errors="replace")
_, status, usage = os.wait4(child.pid, 0)
wall = time.perf_counter() - started
if status != 0 or not out.startswith("hello"):
    sys.exit(f"connect_bench: the {provider} echo client failed ({status}): {out!r}")
# What the connection ran over ("hello (over rdma/shm)"): an RDMA provider that fell back to
# TCP would measure the wrong thing.
transport = out.split("(over ", 1)[-1].rstrip(")\n")
if provider != "tcp" and not transport.startswith("rdma/"):
    sys.exit(f"connect_bench: the {provider} client ran over {transport}")
print(json.dumps({"measure": "client", "place": place, "provider": provider, "transport": transport,
                  "wall_ms": wall * 1e3, "cpu_ms": (usage.ru_utime + usage.ru_stime) * 1e3}))
EOF
}

# round: an echo server per provider (up for the whole round; its first client opens its
# devices and is not counted), then RUNS times every provider's cold run and client run.
round() {
    local provider run log
    declare -A echo_pid echo_addr
    for provider in $PROVIDERS; do
        port=$((port + 1))
        log=$work/echo-$provider.log
        LIGHTPATH_PROVIDERS=$provider "${server_prefix[@]}" "$E" server "$server_addr:$port" 2> "$log" &
        echo_pid[$provider]=$!
        echo_addr[$provider]=$server_addr:$port
        wait_for "echo server on" "$log" "${echo_pid[$provider]}"
        client "$provider" "${echo_addr[$provider]}" > /dev/null
    done
    for run in $(seq "$RUNS"); do
        for provider in $PROVIDERS; do
            cold "$provider" || echo "connect_bench: a cold $provider run failed" >&2
            client "$provider" "${echo_addr[$provider]}" >> "$OUT"
        done
    done
    for provider in $PROVIDERS; do stop "${echo_pid[$provider]}"; done
}

summary() {
    python3 - "$OUT" "$PROVIDERS" "$place" <<'EOF'
import json, statistics, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
providers, place = sys.argv[2].split(), sys.argv[3]
def med(measure, provider, key):
    values = [r[key] for r in rows if r["measure"] == measure and r["provider"] == provider and r["place"] == place]
    return statistics.median(values) if values else None
print(f"\n{place}: medians of the runs; ratio to tcp in brackets (set-up: higher is better; time: lower)")
print(f"{'provider':10} {'cold set-up/s':>20} {'client wall ms':>20} {'client CPU ms':>20}")
base = {k: med(m, "tcp", k) for m, k in (("cold", "setup_per_s"), ("client", "wall_ms"), ("client", "cpu_ms"))}
for provider in providers:
    cells = []
    for measure, key in (("cold", "setup_per_s"), ("client", "wall_ms"), ("client", "cpu_ms")):
        value = med(measure, provider, key)
        if value is None:
            cells.append(f"{'-':>20}")
            continue
        ratio = f" ({value / base[key]:.2f})" if base.get(key) and provider != "tcp" else ""
        cells.append(f"{value:>12.{0 if key == 'setup_per_s' else 2}f}{ratio:>8}")
    print(f"{provider:10} " + " ".join(cells))
EOF
}

round
summary
if [ "$NETNS" = 1 ]; then
    NS_A=lp-ca-$$ NS_B=lp-cb-$$ NS_VETH=lpc NS_NET=10.79.0
    # shellcheck source=scripts/netns.sh
    . scripts/netns.sh
    trap 'netns_down; cleanup' EXIT
    netns_up
    server_prefix=(ip netns exec "$NS_A")
    client_prefix=(ip netns exec "$NS_B")
    server_addr=$NS_NET.1
    place=netns
    PROVIDERS=$(echo "$PROVIDERS" | tr ' ' '\n' | grep -v '^shm$' | tr '\n' ' ')
    round
    summary
fi
