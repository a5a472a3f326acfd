#!/usr/bin/env bash
# The same unmodified programs with and without the preload library (liblightpath_preload.so),
# side by side in one run, on one host (the preload pairs over shm): redis-benchmark
# (PING_INLINE, SET, GET at -c 1 and -c 50: requests/s and p50), iperf3 (single stream,
# forward), wrk against nginx (small file, keep-alive; sendfile and tcp_nopush on, as in
# Debian's nginx.conf: WRK_NOPUSH=off turns the latter off). Prints each pair and the ratio
# preloaded/plain, and after each row's first line, in brackets, the transports the preloaded
# runs' connections with I/O ended on (from their reports: a row that stayed on TCP says so).
# Every server is started fresh per measurement.
#
#   scripts/preload_bench.sh            (builds the release library first)
#   ROUNDS=3 scripts/preload_bench.sh   (medians over rounds)
#   N=20000 IPERF_SECONDS=3 WRK_SECONDS=3 SKIP_REDIS=1 ...   (shorter; no redis rows)
#   NETNS=1 scripts/preload_bench.sh    (also the netns rows; NETNS=only: those alone)
#   PRELOAD_LIB=path/to/liblightpath_preload.so ...   (a library already built, e.g. an older one)
#
# netns rows (NETNS=1 or only; needs root and `ip netns`): redis -c 1 / -c 50, iperf3 and wrk
# against nginx between two network namespaces joined by a veth pair (MTU 1500), the stand-in for two hosts,
# as scripts/compare.sh sets them up: the server in lp-pa-PID (10.77.1.1), the client in
# lp-pb-PID (10.77.1.2). Both preloaded ends get LIGHTPATH_PRELOAD_PEERS=10.77.1.0/24, so the
# connections pair across the namespaces and move to the soft provider (RoCE v2 over UDP);
# PEERS= (empty) leaves the rule out, and the rows then measure what the library costs a
# connection it does not accelerate. The namespaces are removed at exit.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -n "${PRELOAD_LIB:-}" ]]; then
  LIB=$(realpath "$PRELOAD_LIB")
else
  cargo build --release -q -p lightpath-preload
  LIB="${CARGO_TARGET_DIR:-$PWD/target}/release/liblightpath_preload.so"
fi
ROUNDS=${ROUNDS:-1}
NETNS=${NETNS:-0}
WORK=$(mktemp -d)
NS_A=lp-pa-$$
NS_B=lp-pb-$$
NS_VETH=lpp NS_NET=10.77.1
# netns_up / netns_down
. scripts/netns.sh
trap 'kill $(jobs -p) 2>/dev/null || true; wait 2>/dev/null || true; netns_down; rm -rf "$WORK"' EXIT
port=17800
# Where the servers and clients run: `place loopback` (this namespace, 127.0.0.1) or
# `place netns` (see above). SRV/CLI prefix every server/client command; HOST is the address.
SRV=() CLI=() HOST=127.0.0.1 RULE=()
place() {
  if [[ $1 == netns ]]; then
    SRV=(ip netns exec "$NS_A") CLI=(ip netns exec "$NS_B") HOST=10.77.1.1
    RULE=(LIGHTPATH_PRELOAD_PEERS="${PEERS-10.77.1.0/24}")
  else
    SRV=() CLI=() HOST=127.0.0.1 RULE=()
  fi
}

median() { sort -g | awk '{a[NR]=$1} END {if (NR==0) {print "nan"} else {print a[int((NR+1)/2)]}}'; }
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (b > 0) printf "%.2f", a / b; else print "n/a" }'; }
# Every preloaded process reports its connections here (`LIGHTPATH_PRELOAD_REPORT`), so that a
# row whose preloaded run stayed on TCP says so (see `transports`).
REPORT="$WORK/report"
# `with MODE CMD...`: the client CMD with the library (lp) or without (plain), at most 120 s.
with() { local mode=$1; shift; if [[ $mode == lp ]]; then "${CLI[@]}" env LD_PRELOAD="$LIB" LIGHTPATH_PRELOAD_REPORT="$REPORT" "${RULE[@]}" timeout 120 "$@"; else "${CLI[@]}" timeout 120 "$@"; fi; }
# `start MODE CMD...`: the server CMD in the background; $! is its wrapper (timeout, or ip
# netns exec, which execs timeout).
start() { local mode=$1; shift; if [[ $mode == lp ]]; then "${SRV[@]}" env LD_PRELOAD="$LIB" LIGHTPATH_PRELOAD_REPORT="$REPORT" "${RULE[@]}" timeout 300 "$@" & else "${SRV[@]}" timeout 300 "$@" & fi; }
# The transports the preloaded runs' connections with I/O ended on since the last call
# (counted from the reports, e.g. "rdma/soft 40"); then the report starts afresh. A
# preloaded row that was not accelerated shows "tcp" here.
transports() {
  [[ -f $REPORT ]] || { echo "no report"; return; }
  awk '/ transport=/ {
         io = 0
         for (i = 1; i <= NF; i++) if ($i ~ /^(tcp|rdma)_(in|out)=/) { split($i, kv, "="); io += kv[2] }
         if (io == 0) next
         match($0, / transport=[^ ]+/); t = substr($0, RSTART + 11, RLENGTH - 11); n[t]++
       }
       END { s = ""; for (t in n) s = s (s == "" ? "" : ", ") t " " n[t]; print (s == "" ? "none" : s) }' "$REPORT"
  : > "$REPORT"
}
# A connection from the client's place (it closes at once; the servers here accept that).
wait_port() { for _ in $(seq 1 100); do "${CLI[@]}" bash -c "exec 3<>/dev/tcp/$HOST/$1" 2>/dev/null && return 0; sleep 0.05; done; echo "port $1 never opened" >&2; return 1; }

redis_one() { # mode test clients -> "rps p50"
  local mode=$1 test=$2 clients=$3; port=$((port + 1))
  start "$mode" redis-server --port $port --bind "$HOST" --protected-mode no --save '' --appendonly no >/dev/null 2>&1
  local pid=$!; wait_port $port
  local line; line=$(with "$mode" redis-benchmark -h "$HOST" -p $port -t "$test" -n "${N:-100000}" -c "$clients" --csv 2>/dev/null | grep -v '^"test"' | head -1)
  kill $pid 2>/dev/null || true; wait $pid 2>/dev/null || true
  # "test","rps","avg_latency_ms","min_latency_ms","p50_latency_ms",...
  echo "$line" | tr -d '"' | awk -F, '{print $2, $5}'
}

iperf_one() { # mode -> Gbit/s
  local mode=$1; port=$((port + 1))
  start "$mode" iperf3 -s -1 -p $port >/dev/null 2>&1
  local pid=$!; sleep 0.5
  with "$mode" iperf3 -c "$HOST" -p $port -t "${IPERF_SECONDS:-5}" -J 2>/dev/null \
    | python3 -c 'import json,sys; print(json.load(sys.stdin)["end"]["sum_received"]["bits_per_second"]/1e9)'
  kill $pid 2>/dev/null || true; wait $pid 2>/dev/null || true
}

wrk_one() { # mode -> "req/s p50_us"
  local mode=$1; port=$((port + 1))
  mkdir -p "$WORK/www" && echo "hello from nginx" > "$WORK/www/small.txt"
  # sendfile and tcp_nopush (TCP_CORK around each response) on, as in Debian's nginx.conf.
  cat > "$WORK/nginx.conf" <<CONF
daemon off; user root; worker_processes 1; error_log $WORK/error.log; pid $WORK/nginx$port.pid;
events { worker_connections 1024; }
http { access_log off; sendfile on; tcp_nopush ${WRK_NOPUSH:-on}; keepalive_requests 1000000;
  client_body_temp_path $WORK/b; proxy_temp_path $WORK/p; fastcgi_temp_path $WORK/f; uwsgi_temp_path $WORK/u; scgi_temp_path $WORK/s;
  server { listen $HOST:$port; root $WORK/www; } }
CONF
  start "$mode" nginx -c "$WORK/nginx.conf" -p "$WORK" >/dev/null 2>&1
  local pid=$!; wait_port $port
  with "$mode" wrk -t1 -c"${WRK_CONNS:-10}" -d"${WRK_SECONDS:-5}s" --latency "http://$HOST:$port/small.txt" 2>/dev/null \
    | awk '/Requests\/sec/ {rps=$2} /^ +50%/ {v=$2; if (v ~ /ms$/) {sub(/ms/,"",v); v*=1000} else if (v ~ /us$/) {sub(/us/,"",v)} else if (v ~ /s$/) {sub(/s/,"",v); v*=1e6}; p50=v} END {print rps, p50}'
  kill $pid 2>/dev/null || true; wait $pid 2>/dev/null || true
}

# `redis_rows TITLE CLIENTS...`, `iperf_row TITLE`, `wrk_row`: the rows at the current place.
redis_rows() {
  local where=$1; shift
  for clients in "$@"; do
    for test in ping_inline set get; do
      : > "$WORK/p_rps"; : > "$WORK/l_rps"; : > "$WORK/p_p50"; : > "$WORK/l_p50"
      for _ in $(seq 1 "$ROUNDS"); do
        read -r rps p50 <<<"$(redis_one plain $test $clients)"; echo "$rps" >> "$WORK/p_rps"; echo "$p50" >> "$WORK/p_p50"
        read -r rps p50 <<<"$(redis_one lp $test $clients)"; echo "$rps" >> "$WORK/l_rps"; echo "$p50" >> "$WORK/l_p50"
      done
      p=$(median < "$WORK/p_rps"); l=$(median < "$WORK/l_rps")
      printf '%-34s %14s %14s %8s   %s\n' "${where}redis $test -c $clients req/s" "$p" "$l" "$(ratio "$l" "$p")" "[$(transports)]"
      p=$(median < "$WORK/p_p50"); l=$(median < "$WORK/l_p50")
      printf '%-34s %14s %14s %8s\n' "${where}redis $test -c $clients p50 ms" "$p" "$l" "$(ratio "$l" "$p")"
    done
  done
}
iperf_row() {
  : > "$WORK/p"; : > "$WORK/l"
  for _ in $(seq 1 "$ROUNDS"); do iperf_one plain >> "$WORK/p"; iperf_one lp >> "$WORK/l"; done
  p=$(median < "$WORK/p"); l=$(median < "$WORK/l")
  printf '%-34s %14.2f %14.2f %8s   %s\n' "${1}iperf3 1 stream Gbit/s" "$p" "$l" "$(ratio "$l" "$p")" "[$(transports)]"
}
wrk_row() {
  local where=$1
  : > "$WORK/p_rps"; : > "$WORK/l_rps"; : > "$WORK/p_p50"; : > "$WORK/l_p50"
  for _ in $(seq 1 "$ROUNDS"); do
    read -r rps p50 <<<"$(wrk_one plain)"; echo "$rps" >> "$WORK/p_rps"; echo "$p50" >> "$WORK/p_p50"
    read -r rps p50 <<<"$(wrk_one lp)"; echo "$rps" >> "$WORK/l_rps"; echo "$p50" >> "$WORK/l_p50"
  done
  p=$(median < "$WORK/p_rps"); l=$(median < "$WORK/l_rps")
  printf '%-34s %14s %14s %8s   %s\n' "${where}wrk nginx small req/s" "$p" "$l" "$(ratio "$l" "$p")" "[$(transports)]"
  p=$(median < "$WORK/p_p50"); l=$(median < "$WORK/l_p50")
  printf '%-34s %14s %14s %8s\n' "${where}wrk nginx small p50 us" "$p" "$l" "$(ratio "$l" "$p")"
}

printf 'preload benchmark, %s, %s rounds, load average %s\n' "$(date -u +%FT%TZ)" "$ROUNDS" "$(cut -d' ' -f1-3 /proc/loadavg)"
printf '%-34s %14s %14s %8s\n' "test" "plain TCP" "preloaded" "ratio"
have_redis=0
if [[ -z "${SKIP_REDIS:-}" ]] && command -v redis-server >/dev/null && command -v redis-benchmark >/dev/null; then have_redis=1; fi
if [[ $NETNS != only ]]; then
  place loopback
  if [[ $have_redis == 1 ]]; then redis_rows "" 1 50; else
    echo "redis: SKIPPED (SKIP_REDIS set, or redis-server/redis-benchmark not installed)"
  fi
  if command -v iperf3 >/dev/null; then iperf_row ""; else echo "iperf3: SKIPPED (not installed)"; fi
  if command -v nginx >/dev/null && command -v wrk >/dev/null; then wrk_row ""; else
    echo "wrk/nginx: SKIPPED (not installed)"
  fi
fi
if [[ $NETNS == 1 || $NETNS == only ]]; then
  if ! (set -e; netns_up) 2> "$WORK/netns.log"; then
    echo "netns: cannot set up network namespaces (root and ip netns needed): $(tr '\n' ' ' < "$WORK/netns.log")" >&2
    exit 1
  fi
  place netns
  if [[ -n "${PEERS-10.77.1.0/24}" ]]; then
    echo "between two network namespaces (veth, MTU 1500; preloaded ends pair over soft, LIGHTPATH_PRELOAD_PEERS=${PEERS-10.77.1.0/24}):"
  else
    echo "between two network namespaces (veth, MTU 1500; no peer rule: connections stay TCP under the library):"
  fi
  if [[ $have_redis == 1 ]]; then redis_rows "netns " 1 50; fi
  if command -v iperf3 >/dev/null; then iperf_row "netns "; fi
  if command -v nginx >/dev/null && command -v wrk >/dev/null; then wrk_row "netns "; fi
fi
