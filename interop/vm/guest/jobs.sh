# shellcheck shell=bash
# Helpers for job scripts inside the interop VM (copied to /shared/jobs.sh by the host and
# sourced at the top of every job; LP_JOB_ID is set by the agent in lp-init).

# Index of the RoCE v2 GID of the form ::ffff:a.b.c.d (IPv4-mapped) on DEV port 1.
lp_v4gid_index() {
    local dev=${1:-rxe0} idx value type
    # read builtin, no process per entry: the GID table has 1024 slots and forks are slow
    # under TCG
    for idx in 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15; do
        read -r value < "/sys/class/infiniband/$dev/ports/1/gids/$idx" 2> /dev/null || continue
        case "$value" in
            0000:0000:0000:0000:0000:ffff:*)
                read -r type < "/sys/class/infiniband/$dev/ports/1/gid_attrs/types/$idx" 2> /dev/null
                [ "$type" = "RoCE v2" ] || continue
                echo "$idx"
                return 0
                ;;
        esac
    done
    echo "lp_v4gid_index: no IPv4-mapped RoCE v2 GID among the first 16 entries of $dev" >&2
    return 1
}

# Waits up to $2 seconds (default 20) until something listens on TCP port $1.
lp_wait_listening() {
    local port=$1 tries=$(( ${2:-20} * 20 ))
    until ss -Hltn "sport = :$port" | grep -q .; do
        tries=$((tries - 1))
        [ "$tries" -gt 0 ] || return 1
        sleep 0.05
    done
}

# lp_serve PORT CMD...: runs the server CMD, tells the host (jobs/<id>.listening) once it
# listens on PORT, and returns CMD's exit code.
lp_serve() {
    local port=$1 pid rc=0
    shift
    "$@" &
    pid=$!
    if lp_wait_listening "$port" 30; then
        : > "/shared/jobs/$LP_JOB_ID.listening"
    else
        echo "lp_serve: nothing listens on TCP port $port" >&2
    fi
    wait "$pid" || rc=$?
    return "$rc"
}

# lp_pair PORT 'server command' 'client command': both ends inside the VM (rxe loopback).
# Prints both outputs, labelled; fails if either side fails.
lp_pair() {
    local port=$1 server=$2 client=$3 spid src=0 crc=0
    : > "/tmp/$LP_JOB_ID.server.log"
    : > "/tmp/$LP_JOB_ID.client.log"
    bash -c "$server" > "/tmp/$LP_JOB_ID.server.log" 2>&1 &
    spid=$!
    if ! lp_wait_listening "$port" 30; then
        echo "lp_pair: the server never listened on port $port" >&2
        kill "$spid" 2> /dev/null
    else
        bash -c "$client" > "/tmp/$LP_JOB_ID.client.log" 2>&1 || crc=$?
    fi
    wait "$spid" || src=$?
    sed 's/^/[server] /' "/tmp/$LP_JOB_ID.server.log"
    sed 's/^/[client] /' "/tmp/$LP_JOB_ID.client.log" 2> /dev/null
    echo "server rc=$src client rc=$crc"
    [ "$src" = 0 ] && [ "$crc" = 0 ]
}
