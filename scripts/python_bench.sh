#!/usr/bin/env bash
# The Python package's benchmark, as a user runs it: installs ./python into a virtual
# environment that sees Debian's torch, numpy and mpi4py (release build), then
#  1. the same torch.distributed calls (all_reduce, all_gather, broadcast; float32, 8 B to
#     64 MiB per rank) on gloo and on lightpath in one torchrun job, with ratios;
#  2. numpy allreduce with lightpath against mpi4py's Allreduce over Open MPI in one mpirun
#     job, with ratios.
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
py=$(realpath "$venv/bin/python")

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
