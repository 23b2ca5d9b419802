#!/usr/bin/env bash
# The SLURM lane: a real SLURM on this host (tests/slurm_lane). As root (this machine and CI are
# Debian, as root): installs Debian's slurm-wlm and munge with apt when they are missing, writes a
# one-node slurm.conf into a temporary folder (the node claims 8 CPUs, so `srun -n 4` fits on a
# 2-core machine: SlurmdParameters=config_overrides), makes a munge key, starts munged, slurmctld
# and slurmd there (on free ports, so a SLURM already on the host is not touched), waits until
# `sinfo` shows the node idle, and runs pytest tests/slurm_lane with POLYPARALLEL_SLURM_LANE=1 and
# SLURM_CONF set (the tests skip without them). The daemons are always stopped and the folder
# removed (trap on EXIT). Any pytest arguments replace the default selection.
#   bash tools/test-slurm.sh                       # the lane
#   bash tools/test-slurm.sh tests/slurm_lane -k srun -x
# Python: POLYPARALLEL_VENV's, else the `python` on PATH when it imports polyparallel (a worktree
# with `source env.sh` done), else tools/env.sh's .venv. Called by tools/test.sh unless
# POLYPARALLEL_SKIP_LANES=1 or POLYPARALLEL_SKIP_SLURM=1.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
started=$(date +%s)
say() { echo "test-slurm: $*"; }

if [ -n "${POLYPARALLEL_VENV:-}" ]; then
    export PATH="$POLYPARALLEL_VENV/bin:$PATH"
elif ! python -c 'import polyparallel' >/dev/null 2>&1; then
    source "$ROOT/tools/env.sh" || exit 1
fi
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"

if [ "$(id -u)" != 0 ]; then
    say "needs root (it installs slurm-wlm and munge and starts their daemons)" >&2
    exit 1
fi
if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v srun >/dev/null \
        || ! command -v munged >/dev/null; then
    say "installing slurm-wlm and munge"
    export DEBIAN_FRONTEND=noninteractive
    { apt-get update -qq && apt-get install -y -qq --no-install-recommends slurm-wlm munge >/dev/null; } || {
        say "apt-get install slurm-wlm munge failed" >&2; exit 1; }
fi

TMP="$(mktemp -d /tmp/polyparallel-slurm.XXXXXX)"
pids=()
cleanup() {
    local pid
    for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null; done
    for pid in "${pids[@]}"; do
        for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        kill -9 "$pid" 2>/dev/null
    done
    rm -rf "$TMP"
}
trap cleanup EXIT
trap 'exit 130' INT TERM
chmod 700 "$TMP"
mkdir -p "$TMP/munge" "$TMP/state" "$TMP/spool" "$TMP/log"
chmod 700 "$TMP/munge"

# munge: its own key and socket (a munged of the host, if any, is left alone).
dd if=/dev/urandom of="$TMP/munge/munge.key" bs=1024 count=1 status=none
chmod 400 "$TMP/munge/munge.key"
SOCKET="$TMP/munge/munge.socket"
munged --foreground --force --key-file="$TMP/munge/munge.key" --socket="$SOCKET" \
    --pid-file="$TMP/munge/munged.pid" --seed-file="$TMP/munge/munged.seed" \
    --log-file="$TMP/log/munged.log" >>"$TMP/log/munged.out" 2>&1 &
pids+=($!)

free_port() { python -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])'; }
HOST="$(hostname -s)"
export SLURM_CONF="$TMP/slurm.conf"
cat >"$SLURM_CONF" <<EOF
ClusterName=polyparallel-lane
SlurmctldHost=$HOST
SlurmctldPort=$(free_port)
SlurmdPort=$(free_port)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$SOCKET
StateSaveLocation=$TMP/state
SlurmdSpoolDir=$TMP/spool/slurmd-%n
SlurmctldPidFile=$TMP/slurmctld.pid
SlurmdPidFile=$TMP/slurmd-%n.pid
SlurmctldLogFile=$TMP/log/slurmctld.log
SlurmdLogFile=$TMP/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
ReturnToService=2
KillWait=5
InactiveLimit=0
MinJobAge=30
NodeName=$HOST CPUs=8 State=UNKNOWN
PartitionName=lane Nodes=$HOST Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE
EOF

for _ in $(seq 50); do [ -S "$SOCKET" ] && break; sleep 0.1; done
slurmctld -D -i -f "$SLURM_CONF" >>"$TMP/log/slurmctld.out" 2>&1 &
pids+=($!)
slurmd -D -f "$SLURM_CONF" >>"$TMP/log/slurmd.out" 2>&1 &
pids+=($!)

state=""
for _ in $(seq 120); do
    state="$(sinfo -h -n "$HOST" -o %T 2>/dev/null | head -n 1)"
    [ "$state" = idle ] && break
    sleep 0.5
done
if [ "$state" != idle ]; then
    say "the node did not become idle (state: '${state:-none}'); the daemons' logs:" >&2
    tail -n 30 "$TMP"/log/* >&2
    exit 1
fi
say "SLURM up on $HOST after $(( $(date +%s) - started )) s ($(sinfo -V))"

if [ "$#" -eq 0 ] || [[ "$1" == -* ]]; then
    set -- "$@" tests/slurm_lane
fi
POLYPARALLEL_SLURM_LANE=1 python -m pytest -p no:cacheprovider "$@"
code=$?
if [ "$code" != 0 ]; then
    say "pytest failed; the daemons' logs (last lines):" >&2
    tail -n 20 "$TMP"/log/*.log >&2
fi
say "done in $(( $(date +%s) - started )) s"
exit "$code"
