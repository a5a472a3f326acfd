# `stop PID` for the side-by-side scripts (sourced by hyper_bench.sh and connect_bench.sh):
# SIGTERM, then SIGKILL if the process is still there after 2 s, and reap it.

stop() {
    kill "$1" 2> /dev/null || true
    for _ in $(seq 40); do
        kill -0 "$1" 2> /dev/null || break
        sleep 0.05
    done
    kill -9 "$1" 2> /dev/null || true
    wait "$1" 2> /dev/null || true
}
