#!/usr/bin/env bash
# Hierarchical against flat allreduce (or broadcast: TEST=bcast), side by side, over two "hosts": two network namespaces
# joined by a veth pair (MTU 1500; soft RoCE between them), RANKS_PER_HOST ranks in each (shm
# inside). For every size, `lightpath perf TEST` runs once with each algorithm forced
# (LIGHTPATH_COLL_ALLREDUCE or LIGHTPATH_COLL_BCAST) and once with the default choice, one right after the other, then a
# table of median call times and the ratio of each to the flat default (< 1: faster).
#
#   scripts/hier_bench.sh                       sizes 8 B, 64 KiB .. 16 MiB, 2 ranks per host
#   ROUNDS=3 SIZES="1048576 4194304" RANKS_PER_HOST=2 scripts/hier_bench.sh
#   PLACEMENT=cyclic scripts/hier_bench.sh      ranks alternate hosts (0 and 2 on one, 1 and 3 on the other)
#   TEST=bcast scripts/hier_bench.sh            broadcast: default hierarchical binomial chain
#
# Needs root (namespaces). Ranks find each other through torchrun's variables (rank 0 serves
# the store in the first namespace).
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${ROUNDS:-1}
RANKS_PER_HOST=${RANKS_PER_HOST:-2}
SIZES=${SIZES:-"8 65536 262144 1048576 4194304 16777216"}
TEST=${TEST:-allreduce}
if [ "$TEST" = bcast ]; then VAR=LIGHTPATH_COLL_BCAST; DEFAULT_ALGOS="default hierarchical binomial chain"
else VAR=LIGHTPATH_COLL_ALLREDUCE; DEFAULT_ALGOS="default hierarchical rabenseifner ring rd"; fi
ALGOS=${ALGOS:-$DEFAULT_ALGOS}
PLACEMENT=${PLACEMENT:-block}
if [ -z "${LP:-}" ]; then
  cargo build --release -q -p lightpath-cli
  LP=$PWD/target/release/lightpath
fi
# shellcheck source=scripts/netns.sh
. scripts/netns.sh
NS_A=lphier-a-$$ NS_B=lphier-b-$$ NS_VETH=lph NS_NET=10.233.$((RANDOM % 200)).0
NS_NET=${NS_NET%.0}
trap netns_down EXIT
netns_up
WORLD=$((2 * RANKS_PER_HOST))
OUT=target/hier_bench.jsonl
mkdir -p target
: > "$OUT"
echo "# $(date -u +%FT%TZ) $(nproc) CPUs, load $(cut -d' ' -f1-3 /proc/loadavg); $TEST, $WORLD ranks, $RANKS_PER_HOST per namespace ($PLACEMENT)"
port=$((29600 + RANDOM % 300))
for round in $(seq "$ROUNDS"); do
  for size in $SIZES; do
    for algo in $ALGOS; do
      port=$((port + 1))
      pids=()
      for r in $(seq 0 $((WORLD - 1))); do
        if [ "$PLACEMENT" = cyclic ]; then host=$((r % 2)); local_rank=$((r / 2)); else
          host=$((r / RANKS_PER_HOST)); local_rank=$((r % RANKS_PER_HOST)); fi
        ns=$NS_A; [ "$host" = 1 ] && ns=$NS_B
        forced=(); [ "$algo" != default ] && forced=("$VAR=$algo")
        out=/dev/null; [ "$r" = 0 ] && out=$OUT.tmp
        ip netns exec "$ns" env "${forced[@]}" RANK="$r" WORLD_SIZE="$WORLD" LOCAL_RANK="$local_rank" \
          LOCAL_WORLD_SIZE="$RANKS_PER_HOST" MASTER_ADDR="$NS_NET.1" MASTER_PORT="$port" \
          LIGHTPATH_COLL_TIMEOUT_MS=60000 "$LP" perf "$TEST" -s "$size" --json > "$out" &
        pids+=($!)
      done
      failed=0
      for pid in "${pids[@]}"; do wait "$pid" || failed=1; done
      if [ "$failed" = 1 ]; then echo "# $algo $size B failed"; continue; fi
      python3 -c "import json,sys; d=json.loads(open(sys.argv[1]).read().splitlines()[-1]); d['forced']=sys.argv[2]; print(json.dumps(d))" \
        "$OUT.tmp" "$algo" >> "$OUT"
    done
  done
done
rm -f "$OUT.tmp"
python3 - "$OUT" "$ALGOS" <<'PY'
import json, sys, collections, statistics
rows = collections.defaultdict(lambda: collections.defaultdict(list))
chosen = {}
for line in open(sys.argv[1]):
    d = json.loads(line)
    rows[d["size"]][d["forced"]].append(d["p50_us"])
    if d["forced"] == "default":
        chosen[d["size"]] = d.get("algorithm", "?")
algos = sys.argv[2].split()
print("# median call time (us), p50 over ranks, median over rounds; ratio to the fastest flat algorithm")
flat_names = [a for a in algos if a not in ("default", "hierarchical")]
print("%10s %14s" % ("size(B)", "default is") + "".join("%16s" % a for a in algos))
for size in sorted(rows):
    med = {a: statistics.median(v) for a, v in rows[size].items()}
    flat = [med[a] for a in flat_names if a in med]
    best = min(flat) if flat else None
    cells = []
    for a in algos:
        if a not in med:
            cells.append("%16s" % "-")
        elif best:
            cells.append("%9.1f (%.2f)" % (med[a], med[a] / best))
        else:
            cells.append("%16.1f" % med[a])
    print("%10d %14s" % (size, chosen.get(size, "?")) + "".join(cells))
PY
