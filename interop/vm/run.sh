#!/bin/bash
# Boots the interop VM (Linux SoftRoCE, rxe0 on 10.78.0.2), runs one command in it and
# exits with that command's exit code.
#
#   interop/vm/run.sh [options] [--] COMMAND...     COMMAND runs with bash -c in the VM
#   interop/vm/run.sh [options] -f SCRIPT           SCRIPT (a file on the host) runs with bash
#
# Options:
#   -f SCRIPT       run this script file instead of COMMAND
#   -c FILE         copy FILE into the share (it is /shared/<name> in the VM); repeatable
#   -s DIR          share directory (9p, /shared in the VM, the command's working directory);
#                   default: a new directory under $LIGHTPATH_VM_CACHE/runs/
#   -t SECONDS      timeout of the guest command (default 300; 124 = timed out)
#   --mtu N         link MTU of the tap and the VM's eth0 (default 1500 -> RoCE MTU 1024;
#                   9000 -> 4096)
#   --host-cmd CMD  run CMD (bash -c) on the host, inside the namespace, once rxe0 is ACTIVE,
#                   next to the guest command; output in <share>/host.log
#   --pcap FILE     capture UDP port 4791 on the tap to FILE
#   --netns NAME    namespace name (default $LIGHTPATH_NETNS or lp-interop)
#   --no-rxe        do not create rxe0 (UDP 4791 in the VM stays free)
#   -v              print the serial console when the run ends
#
# Exit code: the guest command's; if that is 0 and --host-cmd failed, the host command's.
# 124 = timeout, 125 = no result (the VM died or did not boot; see <share>/console.log).
# Network: namespace with tap lptap0 = 10.78.0.1/24 (host side), VM = 10.78.0.2/24.
# Run interop/vm/build-image.sh first (run-suite.sh does it for you).
set -uo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=lib.sh
source "$here/lib.sh"

usage() { sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; }
die() { echo "run.sh: $*" >&2; exit 2; }

script="" copies=() share="" limit=300 host_cmd="" pcap="" verbose=0
while [ $# -gt 0 ]; do
    case "$1" in
        -f) script=$2; shift 2 ;;
        -c) copies+=("$2"); shift 2 ;;
        -s) share=$2; shift 2 ;;
        -t) limit=$2; shift 2 ;;
        --mtu) LPVM_MTU=$2; shift 2 ;;
        --host-cmd) host_cmd=$2; shift 2 ;;
        --pcap) pcap=$2; shift 2 ;;
        --netns) LPVM_NETNS=$2; shift 2 ;;
        --no-rxe) LPVM_NORXE=1; shift ;;
        -v) verbose=1; shift ;;
        -h | --help) usage; exit 0 ;;
        --) shift; break ;;
        -*) die "unknown option $1 (see --help)" ;;
        *) break ;;
    esac
done
[ "$(id -u)" = 0 ] || die "must run as root (network namespace, tap device)"
if [ -n "$script" ]; then
    [ -r "$script" ] || die "cannot read $script"
    code=$(cat "$script")
elif [ $# -gt 0 ]; then
    code="$*"
else
    die "no command given (see --help)"
fi
[[ "$limit" =~ ^[0-9]+$ ]] || die "-t needs a number of seconds"

if [ -z "$share" ]; then
    share=$LPVM_CACHE/runs/run-$(date +%Y%m%d-%H%M%S)-$$
    # keep the 10 newest default share directories
    ls -1d "$LPVM_CACHE"/runs/run-* 2> /dev/null | head -n -10 | xargs -r rm -rf
fi
mkdir -p "$share" || die "cannot create $share"
LPVM_SHARE=$(cd "$share" && pwd)
for f in "${copies[@]}"; do cp -a "$f" "$LPVM_SHARE/" || die "cannot copy $f"; done
[ -n "$pcap" ] && pcap=$(realpath -m "$pcap")

trap lpvm_cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

t_start=$(lpvm_now)
lpvm_net_up || die "cannot set up namespace $LPVM_NETNS"
if [ -n "$pcap" ]; then lpvm_pcap_start "$pcap" || die "cannot start tcpdump"; fi
lpvm_install_guest_helpers
if ! lpvm_boot; then
    echo "run.sh: the VM did not come up; share: $LPVM_SHARE" >&2
    exit 125
fi

t_cmd=$(lpvm_now)
lpvm_job_start main "$code" "$limit"
host_rc=""
if [ -n "$host_cmd" ]; then
    lpvm_ns_start "$LPVM_SHARE/host.log" "$limit" bash -c "cd '$LPVM_SHARE' && $host_cmd"
    host_pid=$LPVM_BG_PID
fi
rc=0
lpvm_job_wait main $((limit + 30)) || rc=$?
cmd_seconds=$(lpvm_elapsed "$t_cmd")
if [ -n "$host_cmd" ]; then
    host_rc=0
    wait "$host_pid" || host_rc=$?
fi
lpvm_stop
lpvm_pcap_stop

cat "$LPVM_SHARE/jobs/main.log" 2> /dev/null
if [ "$verbose" = 1 ]; then
    echo "---- console.log" >&2
    cat "$LPVM_SHARE/console.log" >&2
fi
if [ -n "$host_cmd" ]; then
    echo "---- host.log (rc=$host_rc)" >&2
    cat "$LPVM_SHARE/host.log" >&2
fi
[ "$rc" = 125 ] && echo "run.sh: no result from the guest; see $LPVM_SHARE/console.log" >&2
printf 'run.sh: accel=%s boot=%ss command=%ss total=%ss rc=%s%s share=%s\n' \
    "$LPVM_ACCEL" "$LPVM_BOOT_SECONDS" "$cmd_seconds" "$(lpvm_elapsed "$t_start")" "$rc" \
    "${host_rc:+ host_rc=$host_rc}" "$LPVM_SHARE" >&2
if [ "$rc" = 0 ] && [ -n "$host_rc" ] && [ "$host_rc" != 0 ]; then rc=$host_rc; fi
exit "$rc"
