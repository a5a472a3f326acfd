#!/usr/bin/env bash
# The Python package's benchmark, as a user runs it: installs ./python into a virtual
# environment that sees Debian's torch, numpy and mpi4py (release build), then
#  1. the same torch.distributed calls (all_reduce, all_gather, broadcast; float32, 8 B to
#     64 MiB per rank) on gloo and on lightpath in one torchrun job, with ratios;
#  2. numpy allreduce with lightpath against mpi4py's Allreduce over Open MPI in one mpirun
#     job, with ratios;
#  3. (root) the torch calls of 1 between two network namespaces joined by a veth pair, one
#     rank in each, one torchrun per namespace: lightpath over soft (RoCE v2 over UDP) against
#     gloo over TCP.
# Usage: scripts/python_bench.sh [RANKS] [MAX_BYTES]   (default 2 ranks, 64 MiB)
set -euo pipefail
cd "$(dirname "$0")/.."
ranks=${1:-2}
max=${2:-67108864}
venv=${LIGHTPATH_BENCH_VENV:-target/python-bench-venv}
if [ ! -x "$venv/bin/python" ]; then
  /usr/bin/python3 -m venv --system-site-packages "$venv"
fi
echo "== pip install ./python (release build) into $venv"
"$venv/bin/pip" install --quiet --force-reinstall --no-deps ./python
py="$(cd "$venv/bin" && pwd)/python"  # not resolved: the symlink is what makes it the venv

echo
echo "== torch.distributed: gloo vs lightpath ($ranks ranks, torchrun)"
if "$py" -c "import torch.distributed.run" 2>/dev/null; then
  "$py" -m torch.distributed.run --nproc_per_node "$ranks" --redirects 1 --tee 1 --standalone \
    python/benchmarks/torch_collectives.py "$max" 2>&1 | grep '^\[default0\]:' | sed 's/^\[default0\]://'
else
  echo "SKIPPED: no torch for /usr/bin/python3 (apt-get install python3-torch)"
fi

echo
echo "== numpy allreduce: mpi4py (Open MPI) vs lightpath ($ranks ranks, mpirun)"
if command -v mpirun >/dev/null && "$py" -c "import mpi4py" 2>/dev/null; then
  OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
    mpirun --oversubscribe -n "$ranks" "$py" python/benchmarks/numpy_vs_mpi4py.py "$max"
else
  echo "SKIPPED: needs mpirun and mpi4py (apt-get install openmpi-bin python3-mpi4py)"
fi

echo
echo "== torch.distributed across two network namespaces: gloo vs lightpath (1 rank per namespace)"
if [ "$(id -u)" != 0 ] || ! command -v ip >/dev/null || ! "$py" -c "import torch.distributed.run" 2>/dev/null; then
  echo "SKIPPED: needs root, iproute2 and torch"
  exit 0
fi
a=lpbench$$a; b=lpbench$$b
cleanup() { ip netns del "$a" 2>/dev/null || true; ip netns del "$b" 2>/dev/null || true; }
trap cleanup EXIT
ip netns add "$a"; ip netns add "$b"
ip link add lpbva netns "$a" type veth peer name lpbvb netns "$b"
ip -n "$a" addr add 10.233.0.1/24 dev lpbva; ip -n "$a" link set lpbva up; ip -n "$a" link set lo up
ip -n "$b" addr add 10.233.0.2/24 dev lpbvb; ip -n "$b" link set lpbvb up; ip -n "$b" link set lo up
for node in 0 1; do
  ns=$a; dev=lpbva
  [ $node = 1 ] && ns=$b && dev=lpbvb
  ip netns exec "$ns" env GLOO_SOCKET_IFNAME=$dev "$py" -m torch.distributed.run --nnodes 2 --node_rank $node \
    --nproc_per_node 1 --master_addr 10.233.0.1 --master_port 29650 --redirects 1 --tee 1 \
    python/benchmarks/torch_collectives.py "$max" > "target/python-bench-netns-$node.log" 2>&1 &
done
wait
grep '^\[default0\]:' target/python-bench-netns-0.log | sed 's/^\[default0\]://'
