#!/usr/bin/env bash
# A one-host Slurm cluster for the Slurm tests (and for trying `launch.scheduler=slurm` by hand).
#
#   tests/cluster/slurm_up.sh          install (if missing), configure and start; wait until idle
#   tests/cluster/slurm_up.sh --stop   stop what it started (by pid)
#
# Two slurmd "nodes", n1 and n2, run on this machine (NodeAddr=127.0.0.1, ports 17001/17002):
# TorchX submits one heterogeneous job with one component per node, and Slurm never places
# two components on one node. The names go into /etc/hosts (the rendezvous endpoint is the
# first node's name). No accounting: torchx-nightly describes jobs with `squeue --json`.
# Finished jobs stay known for an hour (MinJobAge), so tests can read their batch scripts.
# A silent slurmd is noticed after 10 s (SlurmdTimeout; Slurm's default is 300 s) and a
# restarted one returns its node to service (ReturnToService=2): test_slurm_ft.py kills
# one node's slurmd and starts it again.
# Running it again while the cluster is up changes nothing. Needs root (apt-get, /etc).
set -euo pipefail

STATE=${TITAN_SLURM_STATE:-/var/tmp/titan-slurm}
CONF=/etc/slurm/slurm.conf
MARK="# Written by titan_kedro tests/cluster/slurm_up.sh"
NODES=(n1 n2)
PORTS=(17001 17002)
CPUS=${TITAN_SLURM_CPUS:-2}
MEMORY_MB=${TITAN_SLURM_MEMORY_MB:-4096}
PACKAGES=(slurmctld slurmd slurm-client munge slurm-wlm-basic-plugins)

say() { echo "slurm_up: $*" >&2; }
die() { say "$*"; exit 1; }

alive() {  # alive PIDFILE: the process named in PIDFILE runs
  [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null
}

stop_pidfile() {  # stop_pidfile PIDFILE NAME
  local pidfile=$1 name=$2 pid
  alive "$pidfile" || { rm -f "$pidfile"; return 0; }
  pid=$(cat "$pidfile")
  kill -TERM "$pid"
  for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
  if kill -0 "$pid" 2>/dev/null; then kill -KILL "$pid"; fi
  rm -f "$pidfile"
  say "stopped $name (pid $pid)"
}

stop() {
  local node
  for node in "${NODES[@]}"; do stop_pidfile "$STATE/slurmd-$node.pid" "slurmd -N $node"; done
  stop_pidfile "$STATE/slurmctld.pid" slurmctld
  # munged is ours only if this script started it.
  if [ -f "$STATE/munged.ours" ]; then
    stop_pidfile "$STATE/munged.pid" munged
    rm -f "$STATE/munged.ours"
  fi
}

install_packages() {
  local missing=()
  for exe in slurmctld slurmd sbatch munged; do
    command -v "$exe" >/dev/null || missing+=("$exe")
  done
  [ -f /usr/lib/x86_64-linux-gnu/slurm-wlm/openapi_v0_0_38.so ] || missing+=(openapi)
  [ ${#missing[@]} -eq 0 ] && return 0
  command -v apt-get >/dev/null || die "missing ${missing[*]} and no apt-get here: install \
Slurm (slurmctld, slurmd, slurm-client, munge; 22.05+ with the openapi and serializer_json \
plugins for squeue --json) by hand, then run $0 again"
  [ "$(id -u)" -eq 0 ] || die "missing ${missing[*]}: run $0 as root (it calls apt-get)"
  say "installing ${PACKAGES[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${PACKAGES[@]}" >/dev/null
}

write_hosts() {
  local node
  for node in "${NODES[@]}"; do
    getent hosts "$node" >/dev/null || echo "127.0.0.1 $node" >>/etc/hosts
  done
}

write_conf() {
  local host conf
  host=$(hostname)
  if [ -f "$CONF" ] && ! head -1 "$CONF" | grep -qF "$MARK"; then
    die "$CONF exists and was not written by this script: this machine has its own Slurm \
configuration; use that cluster, or move $CONF aside"
  fi
  mkdir -p /etc/slurm "$STATE/ctld"
  conf=$(cat <<EOF
$MARK
ClusterName=titan
SlurmctldHost=$host(127.0.0.1)
SlurmUser=root
AuthType=auth/munge
StateSaveLocation=$STATE/ctld
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmctldLogFile=$STATE/slurmctld.log
SlurmdPidFile=$STATE/slurmd-%n.pid
SlurmdSpoolDir=$STATE/slurmd-%n
SlurmdLogFile=$STATE/slurmd-%n.log
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1
ReturnToService=2
SlurmdTimeout=10
MpiDefault=none
KillWait=10
MinJobAge=3600
NodeName=${NODES[0]} NodeAddr=127.0.0.1 Port=${PORTS[0]} CPUs=$CPUS RealMemory=$MEMORY_MB State=UNKNOWN
NodeName=${NODES[1]} NodeAddr=127.0.0.1 Port=${PORTS[1]} CPUs=$CPUS RealMemory=$MEMORY_MB State=UNKNOWN
PartitionName=debug Nodes=${NODES[0]},${NODES[1]} Default=YES MaxTime=INFINITE State=UP
EOF
)
  if [ ! -f "$CONF" ] || [ "$(cat "$CONF")" != "$conf" ]; then
    printf '%s\n' "$conf" >"$CONF"
    say "wrote $CONF"
    return 1  # changed: running daemons must restart
  fi
}

start_munge() {
  if munge -n </dev/null >/dev/null 2>&1; then return 0; fi
  install -d -o munge -g munge /run/munge
  runuser -u munge -- /usr/sbin/munged
  for _ in $(seq 50); do munge -n </dev/null >/dev/null 2>&1 && break; sleep 0.2; done
  munge -n </dev/null >/dev/null 2>&1 || die "munged did not start"
  cp /run/munge/munged.pid "$STATE/munged.pid"
  touch "$STATE/munged.ours"
  say "started munged (pid $(cat "$STATE/munged.pid"))"
}

idle_nodes() {
  sinfo --noheader --nodes="$(IFS=,; echo "${NODES[*]}")" --format='%n %t' 2>/dev/null |
    awk '$2 == "idle" || $2 == "mix" || $2 == "alloc" {n++} END {print n + 0}'
}

start() {
  install_packages
  mkdir -p "$STATE"
  write_hosts
  local changed=0
  write_conf || changed=1
  if [ "$changed" -eq 1 ]; then stop; fi
  start_munge
  if ! alive "$STATE/slurmctld.pid"; then
    /usr/sbin/slurmctld -f "$CONF"
    say "started slurmctld"
  fi
  local node
  for node in "${NODES[@]}"; do
    mkdir -p "$STATE/slurmd-$node"
    if ! alive "$STATE/slurmd-$node.pid"; then
      /usr/sbin/slurmd -f "$CONF" -N "$node"
      say "started slurmd -N $node"
    fi
  done
  for _ in $(seq 120); do
    [ "$(idle_nodes)" -eq ${#NODES[@]} ] && break
    # A node left down by an earlier run (a daemon killed mid-job) returns to service.
    sinfo --noheader --format='%n %t' 2>/dev/null | awk '$2 ~ /down|drain/ {print $1}' |
      while read -r node; do scontrol update NodeName="$node" State=RESUME || true; done
    sleep 0.5
  done
  if [ "$(idle_nodes)" -ne ${#NODES[@]} ]; then
    sinfo >&2 || true
    die "the nodes did not become idle within 60 s; logs in $STATE"
  fi
  say "cluster up: $(sinfo --noheader --format='%P %D nodes %t' | head -1) (state in $STATE)"
}

case "${1:-}" in
  --stop) stop ;;
  "") start ;;
  *) die "usage: $0 [--stop]" ;;
esac
