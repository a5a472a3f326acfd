#!/usr/bin/env bash
# Connections at scale (issue 15), beside kernel TCP: for each transport, connection count and
# server shape, one `lightpath perf stream_rr` run (64 B requests, ITERS per connection, both
# processes on 127.0.0.1) that reports
#   - set-up rate: connections per second, opened one after another by the client (connect,
#     negotiation, the server's accept and its answer to the opening message);
#   - request rate over all connections;
#   - the server's memory: resident set before the client came and at its peak (from
#     /usr/bin/time), and the growth per connection; the client's peak;
#   - descriptors: the server's before the client and at their peak (sampled every 20 ms from
#     /proc), and per connection; the client's peak.
# One run per cell (a scale run is long); repeat the script for medians.
#
#   scripts/scale.sh                                   # tcp shm soft x 1 100 1000 x threads loop
#   CONNS="1000 5000" PROVIDERS="soft tcp" scripts/scale.sh
#   SHAPES=loop ITERS=50 scripts/scale.sh
#   B=path/to/lightpath scripts/scale.sh               # a binary already built
#   PLACE=netns scripts/scale.sh                     # server and client in two network
#                                                      # namespaces over a veth pair (MTU 1500),
#                                                      # the stand-in for two hosts (root; tcp
#                                                      # and soft: shm needs one namespace)
#
# The raw JSON lines (the client's result plus the measurements) go to $OUT
# (default target/scale.jsonl). The descriptor limit applies to each process (`ulimit -n`).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${B:-}" ]; then
    cargo build --release -q -p lightpath-cli
    B=${CARGO_TARGET_DIR:-target}/release/lightpath
fi
B=$(realpath "$B")
PLACE=${PLACE:-loopback}
if [ "$PLACE" = netns ]; then PROVIDERS=${PROVIDERS:-tcp soft}; else PROVIDERS=${PROVIDERS:-tcp shm soft}; fi
CONNS=${CONNS:-1 100 1000}
SHAPES=${SHAPES:-threads loop}
ITERS=${ITERS:-20}
OUT=${OUT:-target/scale.jsonl}
mkdir -p "$(dirname "$OUT")"
: > "$OUT"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# Below the kernel's ephemeral range (32768-60999 by default): a port some client connection
# was given could not be listened on.
port=$((20000 + RANDOM % 10000))

# Where the two processes run: the same commands, under `ip netns exec` between namespaces
# (it execs the program, so the process /usr/bin/time and timeout start is still Lightpath).
server_prefix=()
client_prefix=()
server_addr=127.0.0.1
case "$PLACE" in
    loopback) ;;
    netns)
        NS_A=lp-sa-$$ NS_B=lp-sb-$$ NS_VETH=lps NS_NET=10.78.0
        # netns_up / netns_down
        . scripts/netns.sh
        trap 'netns_down; rm -rf "$work"' EXIT
        netns_up
        server_prefix=(ip netns exec "$NS_A")
        client_prefix=(ip netns exec "$NS_B")
        server_addr=$NS_NET.1
        ;;
    *)
        echo "scale: PLACE must be loopback or netns, not $PLACE" >&2
        exit 2
        ;;
esac

# The first child of PID (the program /usr/bin/time runs), waited for up to 5 s.
child_of() {
    local pid=$1 child="" i
    [ -n "$pid" ] || return 0
    for i in $(seq 1 250); do
        child=$(pgrep -P "$pid" | head -n 1 || true)
        [ -n "$child" ] && break
        sleep 0.02
    done
    echo "$child"
}

# (Short runs can end between two samples: their peaks read low.)
fds_of() { ls "/proc/$1/fd" 2> /dev/null | wc -l; }
rss_kb_of() { awk '/^VmRSS:/ { print $2 }' "/proc/$1/status" 2> /dev/null || echo 0; }

# Samples the peak descriptor count of PID into FILE until PID exits, every 10 ms, from one
# python process reading the count the kernel gives as the size of /proc/PID/fd (a directory
# listing where it does not). An `ls` every 20 ms took ~6 ms of CPU per sample at 3,000
# descriptors (most of it starting the program), a quarter of a core taken from the processes
# measured, and more from the transport with more descriptors (it halved soft's set-up rate with
# the event-loop server at 1,000 connections).
sample_fds() {
    python3 -S -I - "$1" "$2" << 'PY'
import os, sys, time
pid, file, peak = sys.argv[1], sys.argv[2], -1
while True:
    try:
        n = os.stat(f"/proc/{pid}/fd").st_size or len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        break
    if n > peak:
        peak = n
        with open(file, "w") as f:
            f.write(f"{peak}\n")
    time.sleep(0.01)
PY
}

failures=0
for provider in $PROVIDERS; do
    for shape in $SHAPES; do
        for conns in $CONNS; do
            port=$((port + 1))
            rm -f "$work"/*
            /usr/bin/time -f '%M %U %S' -o "$work/server.time" \
                "${server_prefix[@]}" "$B" perf stream_rr --provider "$provider" -p "$port" --server "$shape" \
                > "$work/server.out" 2> "$work/server.err" &
            server_time=$!
            server=$(child_of "$server_time")
            # Idle: the listener is up.
            for _ in $(seq 1 250); do
                grep -q "waiting for a client" "$work/server.err" 2> /dev/null && break
                sleep 0.02
            done
            idle_fds=$(fds_of "$server")
            idle_rss=$(rss_kb_of "$server")
            sample_fds "$server" "$work/server.fds" &
            # The sampler's first look, before the client comes (a short run can be over
            # before python has started).
            for _ in $(seq 1 250); do
                [ -s "$work/server.fds" ] && break
                sleep 0.01
            done
            rc=0
            /usr/bin/time -f '%M %U %S' -o "$work/client.time" \
                timeout 600 "${client_prefix[@]}" "$B" perf stream_rr "$server_addr" --provider "$provider" -p "$port" \
                --server "$shape" \
                -s 64 -n "$ITERS" --conns "$conns" --json > "$work/client.out" 2> "$work/client.err" &
            client_time=$!
            client=$(child_of "$client_time")
            # `timeout` runs the client as its child.
            client=$(child_of "$client")
            [ -n "$client" ] && sample_fds "$client" "$work/client.fds" &
            wait "$client_time" || rc=$?
            # A server whose client failed may wait for it for good: stop it.
            if [ "$rc" != 0 ] && [ -n "$server" ]; then kill "$server" 2> /dev/null || true; fi
            wait "$server_time" || true
            wait
            if [ "$rc" != 0 ] || ! [ -s "$work/client.out" ]; then
                echo "FAILED: $provider $shape x$conns (client rc=$rc): $(tail -n 2 "$work/client.err" | tr '\n' ' ')" >&2
                failures=$((failures + 1))
                continue
            fi
            python3 - "$work" "$provider" "$shape" "$conns" "$idle_fds" "$idle_rss" "$PLACE" >> "$OUT" << 'EOF'
import json, sys
work, provider, shape, conns, idle_fds, idle_rss, place = sys.argv[1:8]
def peak(name):
    try:
        return int(open(f"{work}/{name}").read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0
result = json.loads(open(f"{work}/client.out").read().strip().splitlines()[-1])
result.update({
    "shape": shape, "place": place,
    "server_idle_fds": int(idle_fds or 0), "server_peak_fds": peak("server.fds"),
    "client_peak_fds": peak("client.fds"),
    "server_idle_rss_kb": int(idle_rss or 0), "server_peak_rss_kb": peak("server.time"),
    "client_peak_rss_kb": peak("client.time"),
})
print(json.dumps(result))
EOF
        done
    done
done

python3 - "$OUT" << 'EOF'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
print(f"{'transport':<10} {'server':<8} {'conns':>6} {'setup/s':>9} {'req/s':>9} "
      f"{'srv RSS MB':>11} {'KB/conn':>8} {'cli RSS MB':>11} {'srv fds':>12} {'fds/conn':>9} {'cli fds':>8}")
for r in rows:
    n = r["conns"]
    grown = max(r["server_peak_rss_kb"] - r["server_idle_rss_kb"], 0)
    fds = max(r["server_peak_fds"] - r["server_idle_fds"], 0)
    print(f"{r['transport']:<10} {r['shape']:<8} {n:>6} {r.get('setup_per_s', 0):>9.0f} "
          f"{r['msg_rate_mpps'] * 1e6:>9.0f} "
          f"{r['server_peak_rss_kb'] / 1024:>11.1f} {grown / n:>8.1f} {r['client_peak_rss_kb'] / 1024:>11.1f} "
          f"{r['server_idle_fds']:>5}->{r['server_peak_fds']:<6} {fds / n:>9.2f} {r['client_peak_fds']:>8}")
EOF
[ "$failures" = 0 ] || { echo "$failures cell(s) failed" >&2; exit 1; }
