#!/usr/bin/env bash
# A single-node Slurm (Debian's slurm-wlm 22.05 with munge) for the collectives' srun test:
# installs the packages, writes a munge key and a minimal slurm.conf for this host, starts
# munged, slurmctld and slurmd, and waits until the node is up. Idempotent: does nothing when
# `sinfo` already answers. On failure it says why; the test then prints SKIPPED.
set -uo pipefail
if command -v sinfo >/dev/null 2>&1 && timeout 5 sinfo -h -o %T 2>/dev/null | grep -qE 'idle|mix|alloc'; then
  exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "ci-deps/slurm: needs root and apt-get; the srun test will print SKIPPED"
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
if ! command -v slurmctld >/dev/null 2>&1; then
  apt-get install -y --no-install-recommends slurm-wlm munge >/dev/null 2>&1 \
    || { apt-get update >/dev/null 2>&1 && apt-get install -y --no-install-recommends slurm-wlm munge >/dev/null 2>&1; } \
    || { echo "ci-deps/slurm: could not install slurm-wlm/munge"; exit 0; }
fi
host=$(hostname)
cpus=$(nproc)
mkdir -p /etc/munge /var/run/munge /var/lib/munge /var/log/munge /etc/slurm /var/spool/slurmctld /var/spool/slurmd /var/log/slurm
if [ ! -s /etc/munge/munge.key ]; then
  dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
fi
chown -R munge:munge /etc/munge /var/run/munge /var/lib/munge /var/log/munge
chmod 400 /etc/munge/munge.key
pgrep -x munged >/dev/null || su -s /bin/sh munge -c /usr/sbin/munged || { echo "ci-deps/slurm: munged did not start"; exit 0; }
cat > /etc/slurm/slurm.conf <<CONF
ClusterName=lightpath
SlurmctldHost=$host
AuthType=auth/munge
ProctrackType=proctrack/pgid
TaskPlugin=task/none
SlurmUser=root
SlurmdUser=root
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
MpiDefault=none
NodeName=$host CPUs=$cpus State=UNKNOWN
PartitionName=ci Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE
CONF
pgrep -x slurmctld >/dev/null || slurmctld || { echo "ci-deps/slurm: slurmctld did not start"; exit 0; }
pgrep -x slurmd >/dev/null || slurmd || { echo "ci-deps/slurm: slurmd did not start"; exit 0; }
for _ in $(seq 30); do
  if timeout 5 sinfo -h -o %T 2>/dev/null | grep -qE 'idle|mix|alloc'; then exit 0; fi
  sleep 1
done
echo "ci-deps/slurm: the node did not come up ($(sinfo -h 2>&1 | head -1)); the srun test will print SKIPPED"
