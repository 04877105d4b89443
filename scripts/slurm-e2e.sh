#!/usr/bin/env bash
# End-to-end test of the SLURM flow of docs/ledger-and-slurm.md, on a real SLURM.
#
#   bash scripts/slurm-e2e.sh            # from anywhere; tests/test_slurm_e2e.py runs it in the suite
#
# 1. scripts/preshuffle.sbatch converts the bundled corpus (examples/data, 434 documents) as a
#    2-task array, 40 samples per shard (11 shards, the last one short); the shards must be
#    byte-identical to a plain `wdsraft convert` of the same input.
# 2. examples/train_array.sbatch trains on them as a chain of array tasks (--array=0-9%1), with
#    `--step-seconds` (a sleep) standing in for the model's step and `--epochs` epochs in all:
#      world size 2: task 0 is cancelled mid-epoch (scancel JOB_0: task 1 resumes), task 1 is
#      requeued mid-epoch (scontrol requeue: task 2 resumes; tasks 3-9 are cancelled before they
#      start, so that the requeued task runs next), task 2 is cancelled in the next epoch, the
#      requeued task resumes as a new run, then the whole array is cancelled;
#      world size 1: a new array resumes elastically, crosses an epoch end, is cancelled mid-epoch;
#      world size 2: a new array resumes elastically and runs to the last epoch; its later tasks
#      find the training done and end at once.
# 3. scripts/slurm_e2e_check.py checks, from the training's own delivery logs and committed
#    checkpoints (not from the ledger), that each epoch consumed every sample exactly once and
#    that the training reached its last epoch.
# 4. examples/mixture/train_mixture.sbatch trains a three-source mixture as a 2-task array, world size 2:
#    task 0 with the first weights, preempted at step 7; task 1 with other weights resumes elastically
#    through the ledger to the epoch's end; `train_mixture.py --check` verifies every sample of every
#    source was delivered once per pass.
#
# SLURM: the one `sinfo` answers from (set SBATCH_PARTITION/SBATCH_ACCOUNT if it needs them;
# everything then goes to a directory under the repository, which must be on a filesystem the
# nodes share). Else, run as root on Debian/Ubuntu, the script installs slurm-wlm and munge with
# apt-get (their services are not started) and starts a one-node cluster by hand: munged,
# slurmctld and slurmd (no systemd), with config, state and logs in a temporary directory
# (SLURM_CONF points the tools at it; nothing is written to /etc), on two free ports. On exit it
# cancels its jobs and stops exactly the daemons it started (and those a killed earlier run of
# this script left behind). Else it prints "SKIPPED: <reason>" and exits 0.
#
# Variables (defaults in brackets):
#   WDSRAFT_SLURM_E2E       [auto] 0: skip; 1: SLURM is required (fail rather than skip);
#                           auto: run where SLURM is or can be installed, skip elsewhere
#   WDSRAFT_SLURM_E2E_DIR   [a new temporary directory; REPO/.slurm-e2e-XXXXXX on a found cluster]
#                           where the shards, the training directory and the logs go (an empty or
#                           new directory; one given here is never removed)
#   WDSRAFT_SLURM_E2E_KEEP  [0] 1: keep the temporary directory (kept anyway when a check fails)
#   PYTHON                  [REPO/.venv/bin/python, else python3] with wdsraft and torch installed
#   EPOCHS [3]  STEP_SECONDS [0.2]  CHECKPOINT_EVERY [4]  the training's knobs
#
# Exit status: 0 passed (or SKIPPED), 1 a check failed or the flow broke.

set -euo pipefail
# The daemons (slurmd, slurmctld, munged) live in sbin, which a minimal PATH (CI's) may leave out.
export PATH=$PATH:/usr/local/sbin:/usr/sbin:/sbin

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
START=$(date +%s)
EPOCHS=${EPOCHS:-3}
STEP_SECONDS=${STEP_SECONDS:-0.2}
CHECKPOINT_EVERY=${CHECKPOINT_EVERY:-4}
MODE=${WDSRAFT_SLURM_E2E:-auto}
CORPUS=$REPO/examples/data/kernel-docs-sample.jsonl.zst
STALE_PREFIX=/tmp/wdsraft-slurm-e2e. # the temporary directories of this script's own clusters

log() { printf '[%4ds] %s\n' "$(($(date +%s) - START))" "$*"; }
fail() {
  log "FAILED: $*"
  FAILED=1
  exit 1
}
skip() {
  [ "$MODE" = 1 ] && fail "SLURM is required (WDSRAFT_SLURM_E2E=1) but: $*"
  echo "SKIPPED: $* (the SLURM end-to-end test did not run)"
  exit 0
}

BASE=""
OWN_BASE=0 # 1: BASE is a temporary directory of ours, removed at the end
CLUSTER="" # the directory of our own cluster (config, state, logs), empty on a found cluster
DAEMONS=() # "pid name" of each daemon we started
JOBS=()    # the jobs we submitted
FAILED=0

case "$MODE" in
  0) skip "WDSRAFT_SLURM_E2E=0" ;;
  1 | auto) ;;
  *) echo "slurm-e2e.sh: WDSRAFT_SLURM_E2E must be 0, 1 or auto, not '$MODE'" >&2 && exit 1 ;;
esac

if [ -z "${PYTHON:-}" ]; then
  PYTHON=python3
  [ -x "$REPO/.venv/bin/python" ] && PYTHON=$REPO/.venv/bin/python
fi
export PYTHON # (sbatch passes the environment on: the jobs use the same interpreter)

# -- the daemons this script starts, and stopping exactly those ----------------------------------------

stop_pid() { # stop_pid PID NAME: TERM, then KILL after 10 s
  local pid=$1 name=$2 i
  kill -0 "$pid" 2> /dev/null || return 0
  kill -TERM "$pid" 2> /dev/null || return 0
  for i in $(seq 1 40); do
    kill -0 "$pid" 2> /dev/null || break
    sleep 0.25
  done
  if kill -0 "$pid" 2> /dev/null; then
    kill -KILL "$pid" 2> /dev/null || true
    log "stopped $name (pid $pid) with SIGKILL"
  else
    log "stopped $name (pid $pid)"
  fi
}

cleanup() {
  local status=$? i entry
  trap - EXIT INT TERM
  if [ "${#JOBS[@]}" -gt 0 ]; then
    scancel "${JOBS[@]}" 2> /dev/null || true
    for i in $(seq 1 60); do # (jobs end before their daemons go: no stray job steps)
      job_gone "$(IFS=, && echo "${JOBS[*]}")" && break
      sleep 0.5
    done
  fi
  for ((i = ${#DAEMONS[@]} - 1; i >= 0; i--)); do
    entry=${DAEMONS[i]}
    stop_pid "${entry%% *}" "${entry#* }"
  done
  [ -n "$CLUSTER" ] && rm -f "$CLUSTER/daemons"
  if [ "$OWN_BASE" = 1 ] && [ -d "$BASE" ]; then
    if [ "$status" -ne 0 ] || [ "$FAILED" = 1 ] || [ "${WDSRAFT_SLURM_E2E_KEEP:-0}" = 1 ]; then
      log "kept $BASE (logs in $BASE/logs${CLUSTER:+, daemon logs in $CLUSTER/log})"
    else
      rm -rf "$BASE"
    fi
  fi
  exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# Daemons a killed earlier run of this script left behind: its directory lists them ("pid name"
# lines, with the script's own pid first). Cancel that cluster's jobs (all of them ours), stop
# the listed daemons whose command line names that directory, and remove the directory.
stop_stale_daemons() {
  local list owner pid name dir i
  for list in "$STALE_PREFIX"*/slurm/daemons; do
    [ -f "$list" ] || continue
    dir=$(dirname "$list")
    owner=$(head -n1 "$list")
    kill -0 "$owner" 2> /dev/null && continue # (that run is still going)
    log "stopping what a killed earlier run left behind in $(dirname "$dir")"
    if SLURM_CONF=$dir/slurm.conf timeout 20 scancel --user="$(id -un)" 2> /dev/null; then
      for i in $(seq 1 40); do
        [ -z "$(SLURM_CONF=$dir/slurm.conf timeout 10 squeue -h -o %i 2> /dev/null)" ] && break
        sleep 0.5
      done
    fi
    tail -n +2 "$list" | tac | while read -r pid name; do # (slurmd, slurmctld, then munged)
      if tr '\0' ' ' < "/proc/$pid/cmdline" 2> /dev/null | grep -q -F "$dir"; then
        stop_pid "$pid" "stale $name"
      fi
    done
    rm -rf "$(dirname "$dir")"
  done
}

# -- SLURM: found, or installed and started here --------------------------------------------------------

found_slurm() {
  command -v sinfo > /dev/null && command -v sbatch > /dev/null \
    && timeout 20 sinfo -h -o %P > /dev/null 2>&1
}

install_slurm() {
  local missing="" tool policy="" aptlog
  for tool in munged munge slurmctld slurmd sbatch srun scontrol squeue scancel sinfo; do
    command -v "$tool" > /dev/null || missing="$missing $tool"
  done
  [ -z "$missing" ] && return 0
  command -v apt-get > /dev/null \
    || skip "no SLURM answers sinfo, and there is no apt-get to install one (missing:$missing)"
  log "installing slurm-wlm and munge with apt-get (missing:$missing)"
  aptlog=$(mktemp)
  # Packages only: a temporary policy-rc.d keeps apt from starting their system services.
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    policy=/usr/sbin/policy-rc.d
    printf '#!/bin/sh\nexit 101\n' > "$policy" && chmod 755 "$policy"
  fi
  local ok=0
  if DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends slurm-wlm munge > "$aptlog" 2>&1; then
    ok=1
  elif apt-get update >> "$aptlog" 2>&1 \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends slurm-wlm munge >> "$aptlog" 2>&1; then
    ok=1
  fi
  [ -n "$policy" ] && rm -f "$policy"
  if [ "$ok" = 0 ]; then
    tail -n 5 "$aptlog" | sed 's/^/    apt-get: /'
    rm -f "$aptlog"
    skip "no SLURM answers sinfo, and apt-get could not install slurm-wlm and munge"
  fi
  rm -f "$aptlog"
}

free_ports() { # two TCP ports free now on 127.0.0.1
  "$PYTHON" - << 'EOF'
import socket
socks = [socket.socket() for _ in range(2)]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(*(s.getsockname()[1] for s in socks))
EOF
}

start_cluster() {
  local node cpus memory ctld_port slurmd_port i state
  CLUSTER=$BASE/slurm
  mkdir -p "$CLUSTER"/{munge,state,spool,log}
  chmod 700 "$CLUSTER/munge"
  echo "$$" > "$CLUSTER/daemons"
  read -r node cpus memory <<< "$(slurmd -C \
    | sed -n 's/^NodeName=\([^ ]*\).* CPUs=\([0-9]*\) .*RealMemory=\([0-9]*\).*/\1 \2 \3/p')"
  [ -n "$node" ] || fail "cannot read the node from 'slurmd -C': $(slurmd -C 2>&1)"
  [ "$cpus" -ge 2 ] || cpus=2 # (two ranks on one node; slurmd accepts it with config_overrides)
  read -r ctld_port slurmd_port <<< "$(free_ports)"

  # munge, with its own key and socket
  dd if=/dev/urandom of="$CLUSTER/munge/munge.key" bs=1024 count=1 status=none
  chmod 400 "$CLUSTER/munge/munge.key"
  local socket=$CLUSTER/munge/munge.socket
  munged --foreground --force --key-file="$CLUSTER/munge/munge.key" --socket="$socket" \
    --pid-file="$CLUSTER/munge/munged.pid" --log-file="$CLUSTER/log/munged.log" \
    --seed-file="$CLUSTER/munge/munged.seed" >> "$CLUSTER/log/munged.out" 2>&1 &
  DAEMONS+=("$! munged")
  echo "$! munged" >> "$CLUSTER/daemons"
  for i in $(seq 1 40); do
    munge -n -S "$socket" 2> /dev/null | unmunge -S "$socket" > /dev/null 2>&1 && break
    [ "$i" = 40 ] && fail "munged does not answer: $(tail -n 5 "$CLUSTER"/log/munged.* 2>&1)"
    sleep 0.25
  done

  : > "$CLUSTER/plugstack.conf"
  # cred_expire=10: a requeued task may start again 11 s after it was requeued (SLURM's default is
  # 120 s); see docs/ledger-and-slurm.md.
  cat > "$CLUSTER/slurm.conf" << EOF
ClusterName=wdsraft-e2e
SlurmctldHost=$node(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$socket,cred_expire=10
StateSaveLocation=$CLUSTER/state
SlurmdSpoolDir=$CLUSTER/spool
SlurmctldPidFile=$CLUSTER/slurmctld.pid
SlurmdPidFile=$CLUSTER/slurmd.pid
SlurmctldLogFile=$CLUSTER/log/slurmctld.log
SlurmdLogFile=$CLUSTER/log/slurmd.log
PlugStackConfig=$CLUSTER/plugstack.conf
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
SlurmdParameters=config_overrides
MpiDefault=none
SwitchType=switch/none
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
ReturnToService=2
KillWait=5
MinJobAge=3600
MessageTimeout=30
InactiveLimit=0
NodeName=$node NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$memory State=UNKNOWN
PartitionName=e2e Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
  export SLURM_CONF=$CLUSTER/slurm.conf
  slurmctld -D -i -f "$SLURM_CONF" >> "$CLUSTER/log/slurmctld.out" 2>&1 &
  DAEMONS+=("$! slurmctld")
  echo "$! slurmctld" >> "$CLUSTER/daemons"
  slurmd -D -f "$SLURM_CONF" -N "$node" >> "$CLUSTER/log/slurmd.out" 2>&1 &
  DAEMONS+=("$! slurmd")
  echo "$! slurmd" >> "$CLUSTER/daemons"
  for i in $(seq 1 120); do
    state=$(sinfo -h -N -o %T 2> /dev/null | head -n1 || true)
    case "$state" in
      idle*) break ;;
      down* | drain* | unknown*) scontrol update NodeName="$node" State=RESUME > /dev/null 2>&1 || true ;;
    esac
    [ "$i" = 120 ] && fail "the node is not idle after 60 s (state '$state'): $(tail -n 5 "$CLUSTER"/log/slurm* 2>&1)"
    sleep 0.5
  done
  log "started a one-node cluster: node $node ($cpus CPUs), slurmctld port $ctld_port, slurmd port $slurmd_port," \
    "munged, config $SLURM_CONF"
}

# -- what the flow needs from the repository ---------------------------------------------------------

check_repository() {
  local train_help option variable
  "$PYTHON" -c 'import wdsraft, torch' 2> /dev/null || fail "$PYTHON cannot import wdsraft and torch (set PYTHON)"
  train_help=$("$PYTHON" "$REPO/examples/train_ledger.py" --help 2>&1) \
    || fail "examples/train_ledger.py --help failed: $train_help"
  for option in --epochs --step-seconds; do
    grep -q -e "$option" <<< "$train_help" \
      || fail "examples/train_ledger.py has no $option option (the stand-in for the model step and the epoch count)"
  done
  for variable in EPOCHS TRAIN_ARGS MASTER_PORT; do
    grep -q "$variable" "$REPO/examples/train_array.sbatch" \
      || fail "examples/train_array.sbatch knows no $variable (EPOCHS, TRAIN_ARGS for --step-seconds, MASTER_ADDR/PORT)"
  done
}

# -- job helpers -----------------------------------------------------------------------------------------

# wait_until TIMEOUT DESCRIPTION COMMAND...: poll COMMAND every half second.
wait_until() {
  local timeout=$1 what=$2 deadline
  shift 2
  deadline=$(($(date +%s) + timeout))
  until "$@"; do
    if [ "$(date +%s)" -ge "$deadline" ]; then
      squeue -h -o '%i %T %r' 2> /dev/null | sed 's/^/    squeue: /' || true
      fail "timed out after ${timeout}s waiting for $what"
    fi
    sleep 0.5
  done
}

job_gone() { [ -z "$(squeue -h -j "$1" -o %i 2> /dev/null)" ]; }

# The states and exit codes of a finished job's tasks, "TASK STATE EXIT" lines (scontrol keeps
# finished jobs for MinJobAge).
task_states() {
  scontrol -o show job "$1" 2> /dev/null \
    | sed -n 's/.*ArrayTaskId=\([^ ]*\) .*JobState=\([A-Z_]*\) .*ExitCode=\([0-9:]*\) .*/\1 \2 \3/p' | sort -n
}

task_running() { [ "$(squeue -h -j "$1" -t RUNNING -o %i 2> /dev/null)" != "" ]; }

# expect_completed JOB COUNT WHAT LOG...: all COUNT tasks of the finished JOB ended COMPLETED with exit 0;
# else the logs' last lines and a failure naming WHAT and every task's state.
expect_completed() {
  local job=$1 count=$2 what=$3 states
  shift 3
  states=$(task_states "$job")
  if [ "$(grep -c ' COMPLETED 0:0$' <<< "$states")" != "$count" ]; then
    tail -n 20 "$@"
    fail "$what tasks: $(tr '\n' ';' <<< "$states")"
  fi
}

# Committed checkpoints of run $1 (every rank's marker written): their steps, one per line.
committed_steps() {
  local dir name ws
  for dir in "$TRAIN"/checkpoints/step-*/run-"$1"; do
    [ -f "$dir/world_size" ] || continue
    ws=$(cat "$dir/world_size")
    [ "$(find "$dir" -maxdepth 1 -name 'rank-*.done' | wc -l)" -eq "$ws" ] || continue
    name=$(basename "$(dirname "$dir")")
    echo $((10#${name#step-}))
  done
}

# Steps at which run $1 ended an epoch (its own log lines).
epoch_end_steps() {
  cat "$LOGS"/*.out 2> /dev/null | sed -n "s/^rank 0\/[0-9]* run $1: epoch [0-9]* done at step \([0-9]*\)$/\1/p"
}

# The newest step at which run $1 delivered a sample (any rank; its delivery logs, written at once).
last_delivered() {
  local log step last=0
  for log in "$TRAIN"/delivered/"$1"-rank-*.log; do
    [ -f "$log" ] || continue
    step=$(tail -n1 "$log" | cut -d' ' -f1)
    [[ $step =~ ^[0-9]+$ ]] && [ "$step" -gt "$last" ] && last=$step
  done
  echo "$last"
}

# mid_epoch RUN N [EPOCHS_DONE]: run RUN has N committed checkpoints of its own past its start,
# has ended EPOCHS_DONE epochs (default 0), and is 2 steps past its newest checkpoint, which is
# not at an epoch's end. (The "epoch E done" line reaches the job log through srun, a little after
# the checkpoint's markers: 2 steps later it is there.)
mid_epoch() {
  local run=$1 want=$2 ends=${3:-0} steps newest start
  start=$(start_step "$run")
  [ -n "$start" ] || return 1
  steps=$(committed_steps "$run" | awk -v s="$start" '$1 > s' | sort -n)
  [ "$(grep -c . <<< "$steps")" -ge "$want" ] || return 1
  newest=$(tail -n1 <<< "$steps")
  [ "$(last_delivered "$run")" -ge $((newest + 2)) ] || return 1
  [ "$(epoch_end_steps "$run" | grep -c .)" -ge "$ends" ] || return 1
  ! epoch_end_steps "$run" | grep -qx "$newest"
}

start_step() { # the step run $1 started at (its first line), empty before it started
  cat "$LOGS"/*.out 2> /dev/null | sed -n "s/^rank 0\/[0-9]* run $1: [a-z]* start at step \([0-9]*\)$/\1/p" | head -n1
}

started() { [ -n "$(start_step "$1")" ]; }

run_id() { echo "slurm${1}.0-restart${2:-0}"; } # run_id JOB_TASK [RESTARTS]: the ledger's run id

# The training array, with world size $1 (ranks on one node): its job id in TRAIN_JOB.
submit_train() {
  local job
  job=$(cd "$REPO" && SHARDS="$SHARDS" WORKDIR="$TRAIN" WORKERS=1 CHECKPOINT_EVERY="$CHECKPOINT_EVERY" \
    EPOCHS="$EPOCHS" TRAIN_ARGS="--step-seconds $STEP_SECONDS" \
    sbatch --parsable --nodes=1 --ntasks-per-node="$1" --cpus-per-task=1 --mem=1G --time=20 \
    --output="$LOGS/%x-%A_%a.out" --open-mode=append examples/train_array.sbatch) \
    || fail "sbatch examples/train_array.sbatch failed"
  TRAIN_JOB=${job%%;*}
  JOBS+=("$TRAIN_JOB")
}

make_base() { # make_base TEMPLATE: BASE, WDSRAFT_SLURM_E2E_DIR if given, else a new directory
  if [ -n "${WDSRAFT_SLURM_E2E_DIR:-}" ]; then
    BASE=$WDSRAFT_SLURM_E2E_DIR
    mkdir -p "$BASE"
    [ -z "$(ls -A "$BASE")" ] || fail "WDSRAFT_SLURM_E2E_DIR $BASE is not empty (a new training needs a new directory)"
  else
    BASE=$(mktemp -d "$1")
    OWN_BASE=1
  fi
}

# -- the flow ----------------------------------------------------------------------------------------------

if found_slurm; then
  check_repository
  make_base "$REPO/.slurm-e2e-XXXXXX"
  log "using the SLURM that sinfo answers from: $(sinfo --version 2> /dev/null)," \
    "partitions $(sinfo -h -o %P | tr '\n' ' ')"
else
  [ "$(id -u)" = 0 ] || skip "no SLURM answers sinfo here, and installing or starting one needs root"
  check_repository
  install_slurm
  stop_stale_daemons
  make_base "${STALE_PREFIX}XXXXXX"
  start_cluster
fi
mkdir -p "$BASE/logs"
LOGS=$BASE/logs
TRAIN=$BASE/train
SHARDS="$BASE/shards/train/train-*.tar"
log "working in $BASE; $(sinfo --version); PYTHON=$PYTHON"

# 1. Convert as a 2-task array, and the same conversion without SLURM.
CONVERT=$(cd "$REPO" && WORKERS=1 WORKDIR="$BASE/convert-work" \
  sbatch --parsable --array=0-1 --cpus-per-task=1 --mem=1G --time=10 --output="$LOGS/%x-%A_%a.log" \
  scripts/preshuffle.sbatch "$CORPUS" "$BASE/shards/train" --samples-per-shard 40) \
  || fail "sbatch scripts/preshuffle.sbatch failed"
CONVERT=${CONVERT%%;*}
JOBS+=("$CONVERT")
log "convert: array job $CONVERT (2 tasks) submitted"
"$PYTHON" -m wdsraft convert -q "$CORPUS" --output "$BASE/plain/train" --samples-per-shard 40 \
  > "$LOGS/plain-convert.log" 2>&1 \
  || fail "the plain wdsraft convert failed: $(tail -n 5 "$LOGS/plain-convert.log")"
wait_until 300 "the convert array $CONVERT to end" job_gone "$CONVERT"
expect_completed "$CONVERT" 2 "convert array" "$LOGS"/preshuffle-*.log
log "convert: both tasks COMPLETED: $(compgen -G "$SHARDS" | wc -l) shards"
(cd "$BASE/shards/train" && find . -maxdepth 1 -type f -print0 | sort -z | xargs -0 sha256sum) > "$LOGS/slurm.sha256"
(cd "$BASE/plain/train" && find . -maxdepth 1 -type f -print0 | sort -z | xargs -0 sha256sum) > "$LOGS/plain.sha256"
if ! diff "$LOGS/plain.sha256" "$LOGS/slurm.sha256" > "$LOGS/sha256.diff"; then
  cat "$LOGS/sha256.diff"
  fail "the shards of the SLURM array differ from those of a plain wdsraft convert"
fi
log "convert: $(wc -l < "$LOGS/slurm.sha256") files (shards, indexes, manifest) byte-identical to a plain" \
  "wdsraft convert (sha256)"

# 2. Train: world size 2, with a cancelled task and a requeued one.
submit_train 2
J1=$TRAIN_JOB
log "train: array job $J1 submitted, world size 2 (--ntasks-per-node=2), $EPOCHS epochs, checkpoint every" \
  "$CHECKPOINT_EVERY steps, $STEP_SECONDS s per step"
RUN=$(run_id "${J1}_0")
wait_until 180 "$RUN to make 2 checkpoints mid-epoch" mid_epoch "$RUN" 2
scancel "${J1}_0"
log "train: scancel ${J1}_0 after its checkpoint at step $(committed_steps "$RUN" | sort -n | tail -n1), mid-epoch"

RUN=$(run_id "${J1}_1")
wait_until 180 "$RUN to make 2 checkpoints mid-epoch" mid_epoch "$RUN" 2
scontrol requeue "${J1}_1" || fail "scontrol requeue ${J1}_1 failed"
log "train: scontrol requeue ${J1}_1 after its checkpoint at step $(committed_steps "$RUN" | sort -n | tail -n1)," \
  "mid-epoch"
REQUEUED=$(run_id "${J1}_1" 1)

# SLURM runs a requeued task after the array's other pending tasks: cancel those (they never
# started) so that the requeued task runs next, once task 2 is cancelled and the requeue delay is over.
RUN=$(run_id "${J1}_2")
wait_until 60 "${J1}_2 to start" task_running "${J1}_2"
scancel "${J1}_[3-9]"
requeue_eligible() { [ "$(squeue -h -j "${J1}_1" -o %r 2> /dev/null)" != BeginTime ]; }
wait_until 180 "the requeued task ${J1}_1 to be eligible" requeue_eligible
wait_until 180 "$RUN to end epoch 0 and make a checkpoint in the next" mid_epoch "$RUN" 1 1
scancel "${J1}_2"
log "train: scancel ${J1}_[3-9] (never started), then ${J1}_2 after its checkpoint at step" \
  "$(committed_steps "$RUN" | sort -n | tail -n1), mid-epoch 1"

wait_until 180 "the requeued task to run again ($REQUEUED)" started "$REQUEUED"
wait_until 180 "$REQUEUED to make a checkpoint mid-epoch" mid_epoch "$REQUEUED" 1
scancel "$J1"
log "train: the requeued task ran as $REQUEUED; scancel $J1 (the whole array) after its checkpoint at step" \
  "$(committed_steps "$REQUEUED" | sort -n | tail -n1)"
wait_until 60 "array $J1 to end" job_gone "$J1"

# 3. World size 1: a new array resumes elastically; cancel it mid-epoch, one epoch later.
submit_train 1
J2=$TRAIN_JOB
log "train: array job $J2 submitted, world size 1"
RUN=$(run_id "${J2}_0")
wait_until 240 "$RUN to end an epoch and make a checkpoint in the next" mid_epoch "$RUN" 2 1
scancel "$J2"
log "train: scancel $J2 after its checkpoint at step $(committed_steps "$RUN" | sort -n | tail -n1), mid-epoch 2"
wait_until 60 "array $J2 to end" job_gone "$J2"

# 4. World size 2 again, to the end: the first task finishes the training, the others find it done.
submit_train 2
J3=$TRAIN_JOB
log "train: array job $J3 submitted, world size 2; waiting for its 10 tasks to end"
wait_until 420 "array $J3 to end" job_gone "$J3"
expect_completed "$J3" 10 "array $J3" "$LOGS/wdsraft-train-${J3}_"*.out
done_tasks=$(grep -l "^rank 0/2: all $EPOCHS epochs done at step" "$LOGS/wdsraft-train-${J3}_"*.out | wc -l)
[ "$done_tasks" -ge 1 ] || fail "no task of $J3 found the training done (\"all $EPOCHS epochs done\")"
log "train: all 10 tasks of $J3 COMPLETED (exit 0); $done_tasks of them found all $EPOCHS epochs done at start"

for job in "$J1" "$J2"; do
  log "train: array $job: $(task_states "$job" | awk '$1 != 4294967294 {print $1 "=" $2}' | tr '\n' ' ')"
done

# 5. The checks, from the delivery logs and the committed checkpoints.
EXPECT=(
  --expect "$(run_id "${J1}_0")=fresh" --expect "$(run_id "${J1}_1")=exact" --expect "$(run_id "${J1}_2")=exact"
  --expect "$REQUEUED=exact" --expect "$(run_id "${J2}_0")=elastic" --expect "$(run_id "${J3}_0")=elastic"
)
if ! "$PYTHON" "$REPO/scripts/slurm_e2e_check.py" --workdir "$TRAIN" --shards "$SHARDS" --logs "$LOGS" \
  --epochs "$EPOCHS" "${EXPECT[@]}"; then
  fail "the delivery logs break the promise (above)"
fi
# 6. A three-source mixture whose weights change between array tasks (examples/mixture): task 0 trains world
# size 2 with the first weights and is preempted at step 7 (its last checkpoint: step 5); task 1 resumes with
# other weights, elastically through the ledger, to the epoch's end. Checked from its delivery logs: every
# sample of every source once per pass.
MIX=$BASE/mixture
BEFORE="web=5 code=3 books=2:3"
AFTER="web=1 code=2 books=6:3"
job=$(cd "$REPO" && WORKDIR="$MIX" WORKERS=1 CHECKPOINT_EVERY=5 SOURCES="$BEFORE" SOURCES_LATER="$AFTER" CHANGE_AT=1 \
  TRAIN_ARGS="--stop-at-step 7" TRAIN_ARGS_LATER="" \
  sbatch --parsable --array=0-1%1 --nodes=1 --ntasks-per-node=2 --cpus-per-task=1 --mem=1G --time=10 \
  --output="$LOGS/%x-%A_%a.out" --open-mode=append examples/mixture/train_mixture.sbatch) \
  || fail "sbatch examples/mixture/train_mixture.sbatch failed"
MIX_JOB=${job%%;*}
JOBS+=("$MIX_JOB")
log "mixture: array job $MIX_JOB submitted (world size 2; weights $BEFORE, then $AFTER from task 1)"
wait_until 300 "the mixture array $MIX_JOB to end" job_gone "$MIX_JOB"
expect_completed "$MIX_JOB" 2 "mixture array" "$LOGS/wdsraft-mixture-${MIX_JOB}_"*.out
grep -q "^rank 0/2 run .*: fresh start at step 0, weights web 5" "$LOGS/wdsraft-mixture-${MIX_JOB}_0.out" \
  || fail "mixture task 0 did not start fresh with the first weights: $(tail -n 5 "$LOGS/wdsraft-mixture-${MIX_JOB}_0.out")"
grep -q "^rank 0/2 run .*: elastic start at step 5, weights web 1" "$LOGS/wdsraft-mixture-${MIX_JOB}_1.out" \
  || fail "mixture task 1 did not resume elastically at step 5: $(tail -n 5 "$LOGS/wdsraft-mixture-${MIX_JOB}_1.out")"
grep -q "^rank 0/2 run .*: the epoch is done" "$LOGS/wdsraft-mixture-${MIX_JOB}_1.out" \
  || fail "mixture task 1 did not reach the epoch's end"
SOURCE_ARGS=()
for source in $AFTER; do SOURCE_ARGS+=(--source "$source"); done
"$PYTHON" "$REPO/examples/mixture/train_mixture.py" --check --workdir "$MIX" --demo-shards "$MIX/demo" \
  "${SOURCE_ARGS[@]}" > "$LOGS/mixture-check.log" 2>&1 || fail "mixture: $(tail -n 3 "$LOGS/mixture-check.log")"
log "mixture: task 0 fresh, preempted at step 7; task 1 elastic from step 5 with new weights to the epoch's end;" \
  "$(tail -n 1 "$LOGS/mixture-check.log")"

log "PASSED: the SLURM flow, $(($(date +%s) - START)) s"
