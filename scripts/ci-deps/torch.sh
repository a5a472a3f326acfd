#!/usr/bin/env bash
# Debian's CPU-only PyTorch (python3-torch 1.13) for the collectives' real-torchrun test.
# About a minute to install; the test prints SKIPPED when it is absent.
set -uo pipefail
if /usr/bin/python3 -c "import torch.distributed.run" >/dev/null 2>&1; then
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "ci-deps/torch: no apt-get; the torchrun test will print SKIPPED"
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get install -y --no-install-recommends python3-torch >/dev/null 2>&1 \
  || { apt-get update >/dev/null 2>&1 && apt-get install -y --no-install-recommends python3-torch >/dev/null 2>&1; } \
  || echo "ci-deps/torch: could not install python3-torch; the torchrun test will print SKIPPED"
