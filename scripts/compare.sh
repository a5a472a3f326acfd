#!/usr/bin/env bash
# Side-by-side numbers of every transport on this machine, in one run: each row runs the same
# test over each provider back to back, so ratios compare runs taken seconds apart. Prints a
# table; the raw JSON lines (each tagged with its row and place) go to $OUT (default
# target/compare.jsonl), which `lightpath plot` can draw.
#
#   scripts/compare.sh                 # every row, on loopback and (when root) between namespaces
#   ROUNDS=5 scripts/compare.sh        # every row five times; the table shows the medians
#   ONLY=stream scripts/compare.sh     # only the stream_* rows (or ONLY=verbs, ONLY=rr)
#   NETNS=0 scripts/compare.sh         # loopback only (NETNS=1: require the namespace run)
#   RR_1000=1 scripts/compare.sh       # stream_rr with 1,000 connections too
#   B=path/to/lightpath scripts/compare.sh   # a binary already built
#
# Places: `loopback` runs server and client on 127.0.0.1; `netns` runs them in two network
# namespaces joined by a veth pair (MTU 1500), the stand-in for two hosts: the server in
# lp-a-PID (10.77.0.1), the client in lp-b-PID (10.77.0.2). shm needs one host and namespace,
# so there only soft and tcp run. The namespaces are removed at exit.
#
# Rows: the verbs tests (which always busy-poll), the stream tests as users run them (default
# options: soft's progress thread, the library's short spin before sleeping) and busy-polled
# (`(busy)`: `--polling`), and stream_rr (64 B requests over 1, 16 and 100 connections; a thread
# per connection on the server, and `(loop)`: one event loop). Latency is one-way (round trip
# / 2) and in µs, the median of the run; bandwidth in MB/s; stream_rr in thousands of requests
# per second. CPU is user + system time of both processes (server and client) over the
# measured iterations: µs per request for latency and rr rows, seconds per GB for bandwidth.
#
# Placement rows: on a virtual machine a wake-up on another, idle CPU costs tens of µs (here
# about 40), so a ping-pong's latency depends on whether the scheduler put both processes on
# one CPU: kernel TCP measured 8-13 µs one way when it did and 47-52 µs when it did not, from
# one run to the next. `stream_lat (1 CPU)` pins server and client to CPU 0, `stream_lat
# (2 CPUs)` the server to CPU 0 and the client to CPU 1 (8 bytes, default options, every
# provider): the unpinned row is what a user gets, these two say which case it was.
#
# Host placement: the host may also move the VM's virtual CPUs between cores that share a
# cache and cores that do not, for seconds to minutes, which changes every copy between the
# two processes several times over (docs/architecture.md, "shm: copies into a peer's memory").
# Before each run a 0.05 s probe (scripts/cross_core_copy.c) times a plain 1 MiB hand-over's
# writer; the `xcore` column is its median over the row's runs in µs (30-50: shared cache,
# 130-230: not), with `*` where the row's probes differ by more than 2x (its runs met both).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${B:-}" ]; then
    cargo build --release -q -p lightpath-cli
    B=${CARGO_TARGET_DIR:-target}/release/lightpath
fi
B=$(realpath "$B")
OUT=${OUT:-target/compare.jsonl}
ROUNDS=${ROUNDS:-1}
ONLY=${ONLY:-all}
RR_1000=${RR_1000:-0}
NETNS_AUTO=0
if [ -z "${NETNS:-}" ]; then
    NETNS_AUTO=1
    if [ "$(id -u)" = 0 ] && ip netns list > /dev/null 2>&1; then NETNS=1; else NETNS=0; fi
fi
# 1,000 shm connections take about 10,000 descriptors per process.
[ "$RR_1000" = 1 ] && { ulimit -n 65536 2> /dev/null || ulimit -n "$(ulimit -Hn)" 2> /dev/null || true; }
mkdir -p "$(dirname "$OUT")"
: > "$OUT"
# shellcheck source=scripts/xcore.sh
. scripts/xcore.sh
xcore_build "$(dirname "$OUT")"
# Below the kernel's ephemeral range (32768-60999 by default): a port some client connection
# was given could not be listened on.
port=$((20000 + RANDOM % 10000))
NS_A=lp-a-$$
NS_B=lp-b-$$

NS_VETH=lpv NS_NET=10.77.0
# netns_up / netns_down
. scripts/netns.sh

# Prefixes of the server's and the client's command (the placement rows pin them).
pin_server=()
pin_client=()

# run PLACE ROW TEST SIZE PROVIDER ITERS [extra client/server args]
run() {
    local place=$1 row=$2 test=$3 size=$4 provider=$5 iters=$6
    shift 6
    port=$((port + 1))
    # The verbs tests' soft devices use their own UDP port, away from any stream device on 4791.
    if [ "$provider" = soft ] && [[ $test != stream_* ]]; then set -- --udp-port 5811 "$@"; fi
    local server_cmd=("${pin_server[@]}" "$B") client_cmd=("${pin_client[@]}" "$B") target=127.0.0.1 client_bind=()
    if [ "$place" = netns ]; then
        server_cmd=("${pin_server[@]}" ip netns exec "$NS_A" "$B")
        client_cmd=("${pin_client[@]}" ip netns exec "$NS_B" "$B")
        target=10.77.0.1
        set -- --bind 10.77.0.1 "$@"
        # The verbs tests' client binds its side too; the stream client's address follows.
        [[ $test == stream_* ]] || client_bind=(--bind 10.77.0.2)
    fi
    "${server_cmd[@]}" perf "$test" --provider "$provider" -p "$port" "$@" > /dev/null 2> "$OUT.server.log" &
    local server=$!
    sleep 0.2
    local args=("$@")
    # The server's --bind is not the client's.
    if [ "$place" = netns ]; then args=("${args[@]:2}"); fi
    local tag="{\"row\":\"$row\",\"where\":\"$place\","
    local xcore
    xcore=$(xcore_probe)
    [ -n "$xcore" ] && tag="$tag\"xcore_us\":$xcore,"
    if timeout 300 "${client_cmd[@]}" perf "$test" "$target" --provider "$provider" -p "$port" -s "$size" \
        -n "$iters" --json "${client_bind[@]}" "${args[@]}" > "$OUT.line"; then
        sed "s/^{/$tag/" "$OUT.line" >> "$OUT"
        wait "$server" || true
    else
        echo "compare: $row $size over $provider ($place) failed" >&2
        sed 's/^/  server: /' "$OUT.server.log" >&2
        kill "$server" 2> /dev/null || true
        wait "$server" 2> /dev/null || true
    fi
}

rows() {
    local place=$1
    local providers=(soft shm tcp)
    [ "$place" = netns ] && providers=(soft tcp)
    if [ "$ONLY" = all ] || [ "$ONLY" = verbs ]; then
        for t in send_lat write_lat read_lat; do
            for p in "${providers[@]}"; do run "$place" "$t" $t 8 "$p" 5000; done
        done
        for p in "${providers[@]}"; do run "$place" send_lat send_lat 4096 "$p" 5000; done
        for t in send_bw write_bw read_bw; do
            for s in 65536 1048576; do
                n=$((s == 65536 ? 5000 : 1000))
                for p in "${providers[@]}"; do run "$place" "$t" $t $s "$p" $n; done
            done
        done
    fi
    if [ "$ONLY" = all ] || [ "$ONLY" = stream ]; then
        for s in 8 4096; do
            for p in "${providers[@]}"; do run "$place" stream_lat stream_lat $s "$p" 5000; done
            for p in "${providers[@]}"; do run "$place" "stream_lat (busy)" stream_lat $s "$p" 5000 --polling; done
        done
        if [ "$(nproc)" -ge 2 ]; then
            pin_server=(taskset -c 0) pin_client=(taskset -c 0)
            for p in "${providers[@]}"; do run "$place" "stream_lat (1 CPU)" stream_lat 8 "$p" 5000; done
            pin_client=(taskset -c 1)
            for p in "${providers[@]}"; do run "$place" "stream_lat (2 CPUs)" stream_lat 8 "$p" 5000; done
            pin_server=() pin_client=()
        fi
        for s in 65536 1048576; do
            n=$((s == 65536 ? 5000 : 1000))
            for p in "${providers[@]}"; do run "$place" stream_bw stream_bw $s "$p" $n; done
            for p in "${providers[@]}"; do run "$place" "stream_bw (busy)" stream_bw $s "$p" $n --polling; done
        done
    fi
    if [ "$ONLY" = all ] || [ "$ONLY" = stream ] || [ "$ONLY" = rr ]; then
        local conns=(1 16 100)
        [ "$RR_1000" = 1 ] && conns+=(1000)
        for c in "${conns[@]}"; do
            # About 20,000 requests per run (at least 20 per connection).
            n=$((20000 / c)); n=$((n < 20 ? 20 : n))
            for p in "${providers[@]}"; do run "$place" "stream_rr x$c" stream_rr 64 "$p" $n --conns "$c"; done
            if [ "$c" -gt 1 ]; then
                for p in "${providers[@]}"; do
                    run "$place" "stream_rr x$c (loop)" stream_rr 64 "$p" $n --conns "$c" --server loop
                done
            fi
        done
    fi
}

places=(loopback)
if [ "$NETNS" = 1 ]; then
    trap netns_down EXIT
    if (set -e; netns_up) 2> "$OUT.netns.log"; then
        places+=(netns)
    elif [ "$NETNS_AUTO" = 1 ]; then
        echo "compare: cannot set up network namespaces, loopback only: $(tr '\n' ' ' < "$OUT.netns.log")" >&2
        netns_down
    else
        cat "$OUT.netns.log" >&2
        exit 1
    fi
    rm -f "$OUT.netns.log"
fi
for _ in $(seq "$ROUNDS"); do
    for place in "${places[@]}"; do rows "$place"; done
done
rm -f "$OUT.line" "$OUT.server.log"

python3 - "$OUT" <<'EOF'
import json, statistics, sys
rows, cpu, xcore = {}, {}, {}
for line in open(sys.argv[1]):
    r = json.loads(line)
    if r["test"] == "stream_rr":
        value = r["msg_rate_mpps"] * 1000
    elif "lat_us" in r:
        value = r["lat_us"]["median"]
    else:
        value = r.get("bw_mb_s")
    if value is None:
        continue
    key = (r.get("where", "loopback"), r.get("row", r["test"]), r["size"])
    provider = r["provider"].split(",")[0]
    rows.setdefault(key, {}).setdefault(provider, []).append(value)
    if "xcore_us" in r:
        xcore.setdefault(key, []).append(r["xcore_us"])
    per = r.get("cpu_us_per_op", r.get("cpu_s_per_gb"))
    if per is not None:
        cpu.setdefault(key, {}).setdefault(provider, []).append(per)
titles = {
    "loopback": "loopback: server and client on 127.0.0.1",
    "netns": "two network namespaces joined by a veth pair (MTU 1500): 10.77.0.1 <- 10.77.0.2",
}
place = None
for key, by in rows.items():
    where, row, size = key
    if where != place:
        place = where
        print(f"\n{titles.get(where, where)}\n")
        print(f"{'test':<22}{'size':>8}{'soft':>10}{'shm':>10}{'tcp':>10}{'soft/tcp':>9}{'shm/tcp':>8}  {'unit':<7}"
              f"|{'CPU soft':>9}{'shm':>8}{'tcp':>8}  {'unit':<7}{'xcore':>7}")
    med = {p: statistics.median(v) for p, v in by.items()}
    cmed = {p: statistics.median(v) for p, v in cpu.get(key, {}).items()}
    test = row.split(" ")[0]
    unit = "kreq/s" if test == "stream_rr" else ("us" if test.endswith("lat") else "MB/s")
    cunit = "s/GB" if test.endswith("bw") else "us/req"
    def cell(p):
        if p not in med:
            return "-"
        return f"{med[p]:.2f}" if unit == "us" else (f"{med[p]:.1f}" if unit == "kreq/s" else f"{med[p]:.0f}")
    def ccell(p):
        if p not in cmed:
            return "-"
        return f"{cmed[p]:.3f}" if cunit == "s/GB" else f"{cmed[p]:.2f}"
    ratio = lambda p: f"{med[p] / med['tcp']:.2f}" if p in med and med.get("tcp") else "-"
    probes = xcore.get(key, [])
    xc = f"{statistics.median(probes):.0f}{'*' if max(probes) > 2 * min(probes) else ''}" if probes else "-"
    print(f"{row:<22}{size:>8}{cell('soft'):>10}{cell('shm'):>10}{cell('tcp'):>10}{ratio('soft'):>9}{ratio('shm'):>8}  {unit:<7}"
          f"|{ccell('soft'):>9}{ccell('shm'):>8}{ccell('tcp'):>8}  {cunit:<7}{xc:>7}")
EOF