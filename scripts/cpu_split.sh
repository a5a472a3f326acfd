#!/usr/bin/env bash
# Where a request's CPU goes (issue 11: "the profile that shows which floor stands in the
# way"): runs `lightpath perf stream_rr` over each provider with `perf record -a` sampling the
# whole machine, and prints microseconds per request of CPU time split into the kernel, user
# space (Lightpath, tokio, libc) and idle, per thread kind, next to the kernel's own floor
# (`scripts/floor_rr.c`: the same exchange with raw sockets and no Lightpath). Both ends run on
# this machine, so "per request" counts both sides; the idle share is what the two cores left
# unused. Compare rows of one run: this machine is noisy.
#
#   scripts/cpu_split.sh                         # soft and tcp, 16 connections, event-loop server
#   PROVIDERS="soft shm tcp" CONNS=64 scripts/cpu_split.sh
#   SHAPE=threads N=20000 scripts/cpu_split.sh   # a thread per connection; requests per connection
#   B=path/to/lightpath scripts/cpu_split.sh     # a binary already built
#
# Needs `perf` (linux-perf) and root (system-wide sampling); cc for the floor row.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${B:-}" ]; then
    cargo build --release -q -p lightpath-cli
    B=${CARGO_TARGET_DIR:-target}/release/lightpath
fi
B=$(realpath "$B")
PROVIDERS=${PROVIDERS:-soft tcp}
CONNS=${CONNS:-16}
SHAPE=${SHAPE:-loop}
N=${N:-20000}
command -v perf > /dev/null || { echo "cpu_split: needs perf (apt-get install linux-perf)" >&2; exit 2; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
port=$((20000 + RANDOM % 10000))

# split DATA REQUESTS LABEL: µs per request by (thread kind, kernel/user/idle).
cat > "$work/split.py" << 'EOF'
import re
import sys

requests, label = float(sys.argv[1]), sys.argv[2]
rows = {}
for line in sys.stdin:
    m = re.match(r"\s+(\d+)\s+(\S.*?)\s{2,}(\S+)\s*$", line)
    if not m:
        continue
    samples, comm, dso = int(m.group(1)), m.group(2).strip(), m.group(3)
    if comm == "swapper":
        kind, comm = "idle", "-"
    else:
        kind = "kernel" if dso.startswith("[kernel") else "user"
        comm = re.sub(r"[-/:].*$", "", comm)
    rows[(comm, kind)] = rows.get((comm, kind), 0) + samples


def us(samples):
    # Sampled at 4000 Hz: one sample is 250 us of one CPU.
    return samples * 250.0 / requests


sums = {k: us(sum(v for (_, kk), v in rows.items() if kk == k)) for k in ("kernel", "user", "idle")}
total = sum(sums.values())
print(f"{label:<14} kernel {sums['kernel']:6.2f}  user {sums['user']:6.2f}  idle {sums['idle']:6.2f}"
      f"  total {total:6.2f} us/request")
for (comm, kind), s in sorted(rows.items(), key=lambda kv: -kv[1]):
    if us(s) >= 0.2 and kind != "idle":
        print(f"{'':<14}   {comm:<18} {kind:<6} {us(s):6.2f}")
EOF
split() {
    perf report -i "$1" --no-children --stdio -g none --sort comm,dso -F sample,comm,dso 2> /dev/null |
        python3 "$work/split.py" "$2" "$3"
}

for provider in $PROVIDERS; do
    port=$((port + 1))
    "$B" perf stream_rr --provider "$provider" -p "$port" --server "$SHAPE" > "$work/server.out" 2> "$work/server.err" &
    server=$!
    for _ in $(seq 1 250); do
        grep -q "waiting for a client" "$work/server.err" 2> /dev/null && break
        sleep 0.02
    done
    perf record -q -a -F 4000 -o "$work/perf.data" -- \
        "$B" perf stream_rr 127.0.0.1 --provider "$provider" -p "$port" --server "$SHAPE" \
        -s 64 -n "$N" --conns "$CONNS" --json > "$work/client.out" 2> "$work/client.err" || {
        echo "cpu_split: the $provider client failed:" >&2
        cat "$work/client.err" >&2
        kill "$server" 2> /dev/null || true
        continue
    }
    wait "$server" 2> /dev/null || true
    rate=$(grep -o '"msg_rate_mpps":[0-9.]*' "$work/client.out" | cut -d: -f2)
    echo "== $provider x$CONNS ($SHAPE server): $(python3 -c "print(f'{float(\"$rate\") * 1000:.1f}')") k requests/s"
    split "$work/perf.data" "$((N * CONNS))" "$provider"
done

if command -v cc > /dev/null; then
    cc -O2 -o "$work/floor_rr" scripts/floor_rr.c
    for mode in tcp udp-soft; do
        requests=$((N * CONNS * 5))
        out=$(ACKS=gso perf record -q -a -F 4000 -o "$work/perf.data" -- "$work/floor_rr" "$mode" "$CONNS" "$((N * 5))")
        echo "== floor $out"
        split "$work/perf.data" "$requests" "floor $mode"
    done
fi
