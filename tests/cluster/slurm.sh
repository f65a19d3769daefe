#!/usr/bin/env bash
# `make test-slurm`: the shipped slurm/rlbus.sbatch on a real four-node Slurm cluster on this one host.
#
# Each node is a network namespace with its own hostname (n1..n4 on a private bridge), so NATS,
# health ports and torchrun's c10d rendezvous behave as on separate machines and the script's
# defaults work unchanged. slurmctld runs on the host side of the bridge. Everything runs inside
# a private mount namespace (its own /etc/hosts); a trap stops the daemons by PID and removes the
# namespaces and the bridge, also when a step fails.
#
#   bash tests/cluster/slurm.sh              # the CI scenarios: 1 learner node, then 2 (torchrun)
#   REPEAT=10 SCENARIOS=2 bash tests/cluster/slurm.sh   # the two-learner-node case ten times
#   SCENARIOS=faults bash tests/cluster/slurm.sh         # only the job whose reward step and a learner rank die
set -euo pipefail
cd "$(dirname "$0")/../.."
REPO=$PWD

if [[ ${1:-} != inner ]]; then
    (( EUID == 0 )) || { echo "test-slurm: needs root (network namespaces, a bridge, slurmd)" >&2; exit 2; }
    if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v sbatch >/dev/null; then
        echo "test-slurm: installing Slurm from Debian's packages"
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurmctld slurmd slurm-client >/dev/null
    fi
    # The private mount namespace holds our /etc/hosts; nothing of it is seen outside.
    exec unshare --mount --propagation private bash "$0" inner
fi

SCENARIOS=${SCENARIOS:-1,2,faults}   # learner node counts to run, in order; faults: 2 learner nodes, kills
REPEAT=${REPEAT:-1}                  # runs per scenario
STEPS=${STEPS:-8}
FAULT_STEPS=${FAULT_STEPS:-30}
NODES=(n1 n2 n3 n4)
BRIDGE=rlbus-sl0
NET=10.231.7
WORK=$(mktemp -d /tmp/rlbus-slurm.XXXXXX)
CTL_PID=""
SLURMD_PIDS=()

log() { echo "test-slurm: $*"; }

teardown() {
    local rc=$?
    set +e
    for pid in "${SLURMD_PIDS[@]}" $CTL_PID; do kill "$pid" 2>/dev/null; done
    for pid in "${SLURMD_PIDS[@]}" $CTL_PID; do
        for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        kill -9 "$pid" 2>/dev/null
    done
    # Whatever a job left in a node namespace (a step that ignored its signal) ends with it.
    for node in "${NODES[@]}"; do
        if ip netns list | grep -qw "rlbus-$node"; then
            for pid in $(ip netns pids "rlbus-$node"); do kill -9 "$pid" 2>/dev/null; done
            ip netns delete "rlbus-$node"
        fi
    done
    ip link show "$BRIDGE" >/dev/null 2>&1 && ip link delete "$BRIDGE"
    (( rc == 0 )) || { log "FAILED (rc $rc); slurm logs:"; tail -n 20 "$WORK"/*.log 2>/dev/null; }
    [[ -n ${KEEP_WORK:-} ]] || rm -rf "$WORK"
    exit "$rc"
}
trap teardown EXIT
trap "exit 130" INT TERM  # so a stopped run still tears down

# ---- network: a bridge on the host side, one namespace per node ---------------------------------
ip link add "$BRIDGE" type bridge
ip addr add "$NET.1/24" dev "$BRIDGE"
ip link set "$BRIDGE" up
{
    echo "127.0.0.1 localhost"
    echo "$NET.1 rlbus-ctl"
    for i in "${!NODES[@]}"; do echo "$NET.$((i + 11)) ${NODES[i]}"; done
} > "$WORK/hosts"
mount --bind "$WORK/hosts" /etc/hosts
for i in "${!NODES[@]}"; do
    node=${NODES[i]} ns=rlbus-${NODES[i]}
    ip netns add "$ns"
    ip link add "veth-$node" type veth peer name eth0 netns "$ns"
    ip link set "veth-$node" master "$BRIDGE" up
    ip -n "$ns" addr add "$NET.$((i + 11))/24" dev eth0
    ip -n "$ns" link set eth0 up
    ip -n "$ns" link set lo up
done

# ---- Slurm: slurmctld on the bridge, a slurmd per node; 32 CPUs and 8 (device-node) GPUs each ----
mkdir -p "$WORK/state" "$WORK/dev"
for g in $(seq 0 7); do mknod "$WORK/dev/gpu$g" c 195 "$g"; done
cat > "$WORK/slurm.conf" <<CONF
ClusterName=rlbus-ci
SlurmctldHost=rlbus-ctl($NET.1)
SlurmctldPort=16817
SlurmUser=root
AuthType=auth/none
CredType=cred/none
StateSaveLocation=$WORK/state
SlurmdSpoolDir=$WORK/spool-%n
SlurmctldPidFile=$WORK/slurmctld.pid
SlurmdPidFile=$WORK/slurmd-%n.pid
SlurmctldLogFile=$WORK/slurmctld.log
SlurmdLogFile=$WORK/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
GresTypes=gpu
SlurmdParameters=config_overrides
ReturnToService=2
MpiDefault=none
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
InactiveLimit=0
KillWait=10
NodeName=n[1-4] NodeAddr=$NET.[11-14] CPUs=32 RealMemory=8000 Gres=gpu:8 Port=17001-17004 State=UNKNOWN
PartitionName=ci Nodes=n[1-4] Default=YES MaxTime=INFINITE State=UP
CONF
echo "Name=gpu File=$WORK/dev/gpu[0-7]" > "$WORK/gres.conf"
export SLURM_CONF=$WORK/slurm.conf

# Each daemon gets the hostname Slurm knows it by (slurmctld checks it; torchrun's c10d rendezvous on a
# node compares the endpoint with it). nsenter, not `ip netns exec`: that one remounts /sys, cgroups gone.
# shellcheck disable=SC2016  # expanded by the inner bash
unshare --uts bash -c 'hostname rlbus-ctl; exec slurmctld -D -f "$1"' _ "$SLURM_CONF" > "$WORK/slurmctld.out" 2>&1 &
CTL_PID=$!
for node in "${NODES[@]}"; do
    mkdir -p "$WORK/spool-$node"
    # shellcheck disable=SC2016  # expanded by the inner bash
    nsenter --net="/run/netns/rlbus-$node" unshare --uts bash -c 'hostname "$1"; exec slurmd -D -N "$1" -f "$2"' \
        _ "$node" "$SLURM_CONF" > "$WORK/slurmd-$node.out" 2>&1 &
    SLURMD_PIDS+=($!)
done
for _ in $(seq 150); do
    idle=$(sinfo -h -N -t idle -o %N 2>/dev/null | sort -u | wc -l)
    (( idle == 4 )) && break
    sleep 0.2
done
sinfo -N
(( idle == 4 )) || { log "nodes did not become idle"; exit 1; }
log "cluster up: $(sinfo -V), 4 nodes idle"

# ---- the shipped script, unchanged, as a user submits it ------------------------------------------
# The trained steps of run dir $1 so far (0 before the first).
steps_done() { local n=0; [[ -f $1/metrics.jsonl ]] && n=$(grep -c '"reward/mean"' "$1/metrics.jsonl"); echo "${n:-0}"; }

wait_steps() {  # $1 = run dir, $2 = steps: wait until the run trained them (or 120 s passed)
    for _ in $(seq 600); do (( $(steps_done "$1") >= $2 )) && return 0; sleep 0.2; done
    log "the run did not reach step $2"; return 1
}

# While job $1 runs (run dir $2): SIGKILL its reward service, then one learner rank (a torchrun worker).
inject_faults() {
    local jobid=$1 run=$2 step worker
    wait_steps "$run" 3 || return 1
    step=$(pgrep -f "rlbus reward --config" | head -n 1)  # the service the reward step runs, as an OOM kill takes it
    log "job $jobid: SIGKILL the reward step's service (pid $step) at step $(steps_done "$run")"
    kill -9 "$step"
    wait_steps "$run" 10 || return 1
    # the worker of rank 1 (not the agent: its command line names torchrun), on the second learner node
    worker=$(pgrep -f "rlbus.learner.main" | while read -r pid; do
        grep -qa torchrun "/proc/$pid/cmdline" || ! tr '\0' '\n' < "/proc/$pid/environ" | grep -qx RANK=1 \
            || echo "$pid"; done | head -n 1)
    log "job $jobid: SIGKILL learner rank 1 (pid $worker) at step $(steps_done "$run")"
    kill -9 "$worker"
}

run_job() {  # $1 = learner nodes, or "faults" (2 learner nodes; the reward step and a learner rank die)
    local learners=$1 jobid state exitcode dir steps=$STEPS save=-1 faults=0 injector=""
    if [[ $learners == faults ]]; then learners=2 steps=$FAULT_STEPS save=5 faults=1; fi
    SUBMITTED=$((SUBMITTED + 1))
    # A fresh job directory and NATS store per submission: job ids restart with each new cluster.
    jobid=$(LEARNER_NODES=$learners GPUS_PER_NODE=0 JOB_DIR="$WORK/job-$SUBMITTED" \
        NATS_STORE="$WORK/nats-store-$SUBMITTED" sbatch --parsable --nodes=4 \
        --output="$WORK/job-%j.out" slurm/rlbus.sbatch \
        "trainer.total_training_steps=$steps" "trainer.save_freq=$save")
    log "job $jobid: LEARNER_NODES=$learners, $steps steps$( (( faults )) && echo ', reward step and a learner rank killed')"
    if (( faults )); then inject_faults "$jobid" "$WORK/job-$SUBMITTED/slurm-$jobid" & injector=$!; fi
    for _ in $(seq "${JOB_POLLS:-900}"); do
        state=$(scontrol show job "$jobid" -o | grep -o 'JobState=[A-Z_]*' | cut -d= -f2)
        [[ $state == PENDING || $state == RUNNING || $state == CONFIGURING || $state == COMPLETING ]] || break
        sleep 0.2
    done
    exitcode=$(scontrol show job "$jobid" -o | grep -o ' ExitCode=[0-9:]*' | cut -d= -f2)
    dir=$WORK/job-$SUBMITTED
    if [[ -n $injector ]] && ! wait "$injector"; then log "job $jobid: the faults were not injected"; return 1; fi
    if [[ $state != COMPLETED || $exitcode != 0:0 ]]; then
        log "job $jobid ended $state, exit $exitcode"
        scontrol show job "$jobid"; sinfo -N -l
        cat "$WORK/job-$jobid.out"; tail -n 30 "$dir"/*.log
        return 1
    fi
    grep -q '"run finished"\|run finished' "$dir/learner.log" || { log "no 'run finished' in learner.log"; return 1; }
    replicas=$(grep '"weights updated"' "$dir/rollout.log" | grep -o '"service": "[^"]*"' | sort -u | wc -l)
    (( replicas == 3 - learners )) || { log "job $jobid: $replicas rollout replicas received weights, want $((3 - learners))"; return 1; }
    "$REPO/.venv/bin/python" tests/cluster/check_run.py "$dir/slurm-$jobid" --steps "$steps"
    if (( faults )); then
        grep -q 'reward exited with .*restarting it (1/' "$dir/reward.log" \
            || { log "job $jobid: the reward step was not restarted"; tail -n 20 "$dir/reward.log"; return 1; }
        grep -q '"resumed from checkpoint"\|resumed from checkpoint' "$dir/learner.log" \
            || { log "job $jobid: the learner did not resume after its rank died"; return 1; }
        # the first restart resumes: no restarted rank reads the dead attempt's addresses (a failed init)
        if grep -n 'connectFullMesh failed\|init_process_group' "$dir/learner.log"; then
            log "job $jobid: a restarted learner rank failed its process-group init"; return 1
        fi
    elif grep -n 'CANCELLED\|unexpected EOF\|Traceback' "$WORK/job-$jobid.out" "$dir"/*.log; then
        log "job $jobid: the logs do not end clean"; cat "$WORK/job-$jobid.out"; return 1
    fi
    log "job $jobid: COMPLETED, exit 0, every replica updated, $(grep -o '"trained.*"duplicates": [0-9]*' "$dir/learner.log")"
}

failures=0 SUBMITTED=0
IFS=, read -ra learner_counts <<< "$SCENARIOS"
for learners in "${learner_counts[@]}"; do
    for r in $(seq "$REPEAT"); do
        if run_job "$learners"; then log "LEARNER_NODES=$learners run $r/$REPEAT: ok"
        else log "LEARNER_NODES=$learners run $r/$REPEAT: FAILED"; failures=$((failures + 1)); fi
    done
done
(( failures == 0 )) || { log "$failures job(s) failed"; exit 1; }
log "all jobs passed"
