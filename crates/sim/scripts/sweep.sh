#!/bin/bash
# Seed sweep of `lightpath sim` across fault mixes, MTUs, topologies, negative-case rates,
# retry counts and IP families. Prints one line per configuration (passed/failed) and the
# first failures of each, and exits 1 if any seed failed.
#
#   crates/sim/scripts/sweep.sh [SEEDS_PER_CONFIG] [FIRST_SEED]
#
# LIGHTPATH names the binary (default: target/release/lightpath; build it with
# `cargo build --release -p lightpath-cli`). SHOW sets how many failures are shown per config.
set -u
seeds=${1:-1000}
first=${2:-0}
bin=${LIGHTPATH:-target/release/lightpath}
show=${SHOW:-3}

configs=(
  ""
  "--loss 0.01"
  "--loss 0.05"
  "--loss 0.2 --max-message 65536"
  "--loss 0.5 --max-message 16384"
  "--dup 0.05"
  "--dup 0.2"
  "--reorder 0.05"
  "--reorder 0.2"
  "--reorder 0.5"
  "--corrupt 0.01"
  "--corrupt 0.05"
  "--loss 0.05 --dup 0.02 --reorder 0.05 --corrupt 0.01"
  "--loss 0.2 --dup 0.1 --reorder 0.2 --corrupt 0.05 --max-message 65536"
  "--mtu 256 --loss 0.05 --reorder 0.05"
  "--mtu 1024 --loss 0.05 --dup 0.05"
  "--mtu 4096 --loss 0.05 --reorder 0.2"
  "--nodes 3 --loss 0.05 --reorder 0.05"
  "--nodes 3 --dup 0.1 --reorder 0.2 --negative 0.5"
  "--negative 0 --loss 0.05 --reorder 0.2"
  "--negative 1 --loss 0.05"
  "--negative 1 --reorder 0.5"
  "--negative 1 --dup 0.2 --reorder 0.2"
  "--negative 1 --max-ops 4 --max-message 4096 --ops fetch_add,cmp_swap,read,write,send --loss 0.1 --reorder 0.3"
  "--retry-cnt 1 --loss 0.01"
  "--retry-cnt 1 --reorder 0.2"
  "--retry-cnt 2 --loss 0.05 --negative 0.5"
  "--receive-batch-us 5 --negative 1"
  "--receive-batch-us 10 --loss 0.05 --dup 0.05 --reorder 0.05 --corrupt 0.01"
  "--receive-batch-us 50 --reorder 0.2 --negative 0.5 --nodes 3"
  "--family v4 --loss 0.05 --reorder 0.05"
  "--family v6 --loss 0.05 --reorder 0.05 --corrupt 0.02"
  "--family v4 --corrupt 0.05"
)

status=0
for config in "${configs[@]}"; do
  # shellcheck disable=SC2086 # each config is a list of options
  out=$("$bin" sim --seeds "$seeds" --seed-start "$first" $config)
  code=$?
  line=$(grep -E '^seeds:' <<<"$out")
  printf '%-40s | %s\n' "$line" "${config:-(clean)}"
  if [ "$code" -ne 0 ]; then
    status=1
    grep '^FAIL' <<<"$out" | head -n "$show"
  fi
done
exit $status
