#!/usr/bin/env bash
# Debian packages the Python package's tests (python/tests/python.rs) and benchmark use:
# pip and venv (the `pip install ./python` test; pip fetches maturin from PyPI), numpy, and
# mpi4py for scripts/python_bench.sh. torch comes from ci-deps/torch.sh, mpirun from
# ci-deps/collectives.sh. Tests whose module is missing print SKIPPED.
set -uo pipefail
need=()
/usr/bin/python3 -c "import numpy" >/dev/null 2>&1 || need+=(python3-numpy)
/usr/bin/python3 -c "import pip" >/dev/null 2>&1 || need+=(python3-pip)
/usr/bin/python3 -c "import venv, ensurepip" >/dev/null 2>&1 || need+=(python3-venv)
/usr/bin/python3 -c "import mpi4py" >/dev/null 2>&1 || need+=(python3-mpi4py)
[ ${#need[@]} -eq 0 ] && exit 0
if ! command -v apt-get >/dev/null 2>&1; then
  echo "ci-deps/python: no apt-get; tests needing ${need[*]} will print SKIPPED"
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get install -y --no-install-recommends "${need[@]}" >/dev/null 2>&1 \
  || { apt-get update >/dev/null 2>&1 && apt-get install -y --no-install-recommends "${need[@]}" >/dev/null 2>&1; } \
  || echo "ci-deps/python: could not install ${need[*]}; tests needing them will print SKIPPED"
