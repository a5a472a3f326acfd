#!/usr/bin/env bash
# Debian programs the preload library's tests run (crates/preload/tests): socat, curl, nginx,
# redis (server, benchmark, cli), memcached with libmemcached's tools, iperf3, wrk (for
# scripts/preload_bench.sh), iproute2 (`ip netns`: tests/namespaces.rs). Their packaged services are stopped: the tests start their own.
set -uo pipefail
command -v apt-get >/dev/null 2>&1 || { echo "ci-deps/preload: no apt-get; the preload tests skip missing programs"; exit 0; }
packages=(socat curl nginx-light redis-server redis-tools memcached libmemcached-tools iperf3 wrk python3 iproute2)
missing=()
for p in "${packages[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if ((${#missing[@]})); then
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y --no-install-recommends "${missing[@]}" >/dev/null 2>&1 \
    || { apt-get update >/dev/null 2>&1 && apt-get install -y --no-install-recommends "${missing[@]}" >/dev/null 2>&1; } \
    || echo "ci-deps/preload: could not install ${missing[*]}; those tests print SKIPPED"
fi
for service in nginx redis-server memcached; do
  if command -v service >/dev/null 2>&1; then service "$service" stop >/dev/null 2>&1 || true; fi
done
exit 0
