#!/usr/bin/env bash
# Debian packages the collectives tests and benchmark compare against: Open MPI's mpirun and
# mpicc (openmpi-bin, libopenmpi-dev). Tests that need them print SKIPPED when they are absent;
# CI installs them here so those tests really run.
set -uo pipefail
if command -v mpirun >/dev/null 2>&1 && command -v mpicc >/dev/null 2>&1; then
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "ci-deps/collectives: no apt-get; mpirun tests will print SKIPPED"
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get install -y --no-install-recommends openmpi-bin libopenmpi-dev >/dev/null 2>&1 \
  || { apt-get update >/dev/null 2>&1 && apt-get install -y --no-install-recommends openmpi-bin libopenmpi-dev >/dev/null 2>&1; } \
  || echo "ci-deps/collectives: could not install openmpi-bin/libopenmpi-dev; mpirun tests will print SKIPPED"
