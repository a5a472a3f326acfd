#!/usr/bin/env bash
# Lightpath collectives against Open MPI's, side by side: for every size, `lightpath perf TEST`
# under `lightpath launch` and the same loop with MPI (crates/collectives/bench/mpi_coll.c,
# built with Debian's mpicc) under mpirun, one right after the other, then a table with the
# ratios lightpath / Open MPI of the average, median (p50), 90th percentile (p90) and minimum
# call times (< 1: Lightpath is faster). On a shared machine the median is the steadiest: a few
# calls that lose the CPU for milliseconds move the average; p90 shows whether such calls are
# rare. Both loops fill their buffers with the same bytes (ones: see mpi_coll.c).
#
#   scripts/coll_compare.sh [TEST...]        default: allreduce bcast
#   RANKS=2 MIN=8 MAX=64M MPI_ARGS="" ROUNDS=1 scripts/coll_compare.sh allreduce
#   LP=/tmp/lightpath-old scripts/coll_compare.sh allreduce    # another build, same table
#   TOUCH=1 scripts/coll_compare.sh allgather   # each call's data rewritten before the call,
#                                               # on both sides: fresh, as gradients (--touch)
#   SIZES="8 65536 1048576" LP_ENV="LIGHTPATH_PROVIDERS=soft" \
#     MPI_ARGS="--mca btl tcp,self --mca btl_tcp_if_include lo" scripts/coll_compare.sh allreduce
#
# Cross-core copies on a VM: the host may move its virtual CPUs between cores that share a
# cache and cores that do not, which makes every copy between two ranks several times slower
# for seconds to minutes (docs/architecture.md, "shm: copies into a peer's memory"). Before
# each run a 0.05 s probe (scripts/cross_core_copy.c) times a plain 1 MiB copy into memory the
# other core read last; the table's `xcore` column gives its median in µs before Lightpath's
# runs / Open MPI's (~30-50 where the cores share a cache, 130-230 where they do not). A row
# whose two differ a lot compared the two under different conditions.
#
# Both run with default settings, as a user would (Open MPI picks vader on one host; pass
# MPI_ARGS="--mca btl tcp,self --mca btl_tcp_if_include lo" for its TCP transport).
# Needs openmpi-bin and libopenmpi-dev (scripts/ci-deps/collectives.sh installs them).
set -euo pipefail
cd "$(dirname "$0")/.."
TESTS=("${@:-allreduce bcast}")
[ $# -eq 0 ] && TESTS=(allreduce bcast)
RANKS=${RANKS:-2}
MIN=${MIN:-8}
MAX=${MAX:-64M}
ROUNDS=${ROUNDS:-1}
MPI_ARGS=${MPI_ARGS:-}
LP_ENV=${LP_ENV:-}
SIZES=${SIZES:-}
TOUCH=${TOUCH:-0}
LP_TOUCH=(); MPI_TOUCH=()
if [ "$TOUCH" = 1 ]; then LP_TOUCH=(--touch); MPI_TOUCH=(touch); fi
to_bytes() { python3 -c "import sys; t=sys.argv[1]; m={'K':1<<10,'M':1<<20,'G':1<<30}; print(int(t[:-1])*m[t[-1]] if t[-1] in m else int(t))" "$1"; }
MINB=$(to_bytes "$MIN"); MAXB=$(to_bytes "$MAX")
command -v mpicc >/dev/null || { echo "coll_compare: mpicc missing (apt-get install openmpi-bin libopenmpi-dev)"; exit 1; }
# LP=/path/to/lightpath: measure that binary (say, an older build) instead of building this tree.
if [ -z "${LP:-}" ]; then
  cargo build --release -q -p lightpath-cli
  LP=target/release/lightpath
fi
mkdir -p target/coll_compare
mpicc -O2 -o target/coll_compare/mpi_coll crates/collectives/bench/mpi_coll.c
# shellcheck source=scripts/xcore.sh
. scripts/xcore.sh
xcore_build target/coll_compare
# probe TEST SIZE IMPL: one JSON line with the plain writer's µs per 1 MiB hand-over now.
probe() {
  local us
  us=$(xcore_probe)
  [ -n "$us" ] && echo "{\"probe\":true,\"test\":\"$1\",\"size\":$2,\"impl\":\"$3\",\"writer_us\":$us}" >> "$OUT"
  return 0
}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
OUT=target/coll_compare/results.jsonl
: > "$OUT"
echo "# $(date -u +%FT%TZ) $(nproc) CPUs, load $(cut -d' ' -f1-3 /proc/loadavg); ranks=$RANKS; touch=$TOUCH; lightpath env: ${LP_ENV:-default}; Open MPI $(mpirun --version 2>/dev/null | head -1 | awk '{print $NF}') args: ${MPI_ARGS:-default}"
for round in $(seq "$ROUNDS"); do
  for test in "${TESTS[@]}"; do
    if [ -n "$SIZES" ]; then list=($SIZES); elif [ "$test" = barrier ]; then list=(0); else
      list=(); s=$MINB; while [ "$s" -le "$MAXB" ]; do list+=("$s"); s=$((s * 2)); done; fi
    for size in "${list[@]}"; do
      probe "$test" "$size" lightpath
      # shellcheck disable=SC2086
      env $LP_ENV "$LP" launch -n "$RANKS" -- "$LP" perf "$test" -s "$size" --json "${LP_TOUCH[@]}" >> "$OUT" \
        || echo "# lightpath $test $size B failed (exit $?)"
      probe "$test" "$size" openmpi
      # shellcheck disable=SC2086
      mpirun --oversubscribe -n "$RANKS" $MPI_ARGS target/coll_compare/mpi_coll "$test" "$size" 0 "$size" "${MPI_TOUCH[@]}" >> "$OUT" 2>/tmp/coll_compare_mpi.err \
        || echo "# openmpi $test $size B failed (exit $?): $(grep -m1 -v '^-*$' /tmp/coll_compare_mpi.err)"
    done
  done
done
python3 - "$OUT" <<'PY'
import json, sys, collections
rows = collections.defaultdict(lambda: collections.defaultdict(list))
probes = collections.defaultdict(lambda: collections.defaultdict(list))
for line in open(sys.argv[1]):
    line = line.strip()
    if not line.startswith("{"):
        continue
    r = json.loads(line)
    (probes if r.get("probe") else rows)[(r["test"], r["size"])][r["impl"]].append(r)
print(f"{'test':<15}{'size(B)':>10}{'lightpath avg':>15}{'p50':>9}{'p90':>9}{'min':>9}{'openmpi avg':>13}{'p50':>9}{'p90':>9}{'min':>9}"
      f"{'ratio avg':>11}{'ratio p50':>10}{'ratio p90':>10}{'ratio min':>10}{'xcore':>10}")
# Median over rounds; None where a run did not report the figure (an older binary: no p90).
def med(xs, k):
    vals = sorted(x[k] for x in xs if k in x)
    return vals[len(vals) // 2] if vals else None
num = lambda v, w: f"{v:>{w}.2f}" if v is not None else f"{'-':>{w}}"
ratio = lambda a, b, w: num(a / b if a is not None and b else None, w)
for (test, size), impls in sorted(rows.items()):
    lp, mp = impls.get("lightpath"), impls.get("openmpi")
    if not lp or not mp:
        continue
    la, lp50, lp90, lm = (med(lp, k) for k in ("avg_us", "p50_us", "p90_us", "min_us"))
    oa, op50, op90, om = (med(mp, k) for k in ("avg_us", "p50_us", "p90_us", "min_us"))
    xl, xo = (med(probes[(test, size)].get(impl, []), "writer_us") for impl in ("lightpath", "openmpi"))
    xcore = f"{xl:.0f}/{xo:.0f}" if xl is not None and xo is not None else "-"
    print(f"{test:<15}{size:>10}{num(la, 15)}{num(lp50, 9)}{num(lp90, 9)}{num(lm, 9)}{num(oa, 13)}{num(op50, 9)}{num(op90, 9)}{num(om, 9)}"
          f"{ratio(la, oa, 11)}{ratio(lp50, op50, 10)}{ratio(lp90, op90, 10)}{ratio(lm, om, 10)}{xcore:>10}")
PY
