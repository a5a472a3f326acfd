# The host-placement probe for the side-by-side scripts (sourced by compare.sh and
# coll_compare.sh): `xcore_build DIR` compiles scripts/cross_core_copy.c into DIR (probes are
# skipped without a C compiler); `xcore_probe` prints the plain writer's µs for one 1 MiB
# hand-over between the two cores now (0.05 s; ~30-50 where they share a cache, 130-230
# where they do not: docs/architecture.md, "shm: copies into a peer's memory"), or nothing.

XCORE_BIN=

xcore_build() {
    if cc -O2 -pthread -o "$1/cross_core_copy" scripts/cross_core_copy.c 2> /dev/null; then
        XCORE_BIN=$1/cross_core_copy
    fi
}

xcore_probe() {
    [ -n "$XCORE_BIN" ] || return 0
    "$XCORE_BIN" 0.05 | awk '/^plain/ {print $5; exit}'
}
