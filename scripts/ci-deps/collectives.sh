#!/usr/bin/env bash
# Debian packages the collectives tests and benchmark need or compare against: Open MPI's
# mpirun and mpicc (openmpi-bin, libopenmpi-dev), and the C and C++ compilers the C ABI's tests
# (crates/collectives-c) build their program and check the header with (gcc, g++). Tests that
# need mpirun print SKIPPED when it is absent; CI installs everything here so those tests run.
set -uo pipefail
need=()
command -v mpirun >/dev/null 2>&1 && command -v mpicc >/dev/null 2>&1 || need+=(openmpi-bin libopenmpi-dev)
command -v cc >/dev/null 2>&1 || need+=(gcc)
command -v c++ >/dev/null 2>&1 || need+=(g++)
if [ ${#need[@]} = 0 ]; then
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "ci-deps/collectives: no apt-get to install ${need[*]}"
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get install -y --no-install-recommends "${need[@]}" >/dev/null 2>&1 \
  || { apt-get update >/dev/null 2>&1 && apt-get install -y --no-install-recommends "${need[@]}" >/dev/null 2>&1; } \
  || echo "ci-deps/collectives: could not install ${need[*]}"
