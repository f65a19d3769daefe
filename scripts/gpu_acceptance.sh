#!/usr/bin/env bash
# The GPU tests and the figures the README quotes, in parts that each fit a 10-minute slot on one GPU (H100/H200):
#   bash scripts/gpu_acceptance.sh 0   # make test-gpu
#   bash scripts/gpu_acceptance.sh 1   # a plain `rlbus up` with a timestamp on every console line (and its services'
#                                      # logs: up-logs.tgz), checkpoint cost,
#                                      # decode tokens/s (bench/rollout.py, 0.5B shape, 512 x 128, against generate's
#                                      # against one decode compile for every row bucket (start s: the
#                                      # compiles) and against SDPA's kernels in the decode step;
#                                      # DECODE_ENGINES=hf,hf-unfused,hf-unplanned adds the unfused engine, 70 s more;
#                                      # one more batch profiled: rollout.log; then one decode step's
#                                      # attention per kernel: bench/decode_attention.py)
#   bash scripts/gpu_acceptance.sh 2   # bench/e2e_gpu.py: rlbus async 0/1 beside TRL + static cache, 3 paired rounds
#                                      # (E2E_VARIANT: rlbus's overrides, joined by commas)
#   bash scripts/gpu_acceptance.sh 3   # bench/learning.py (pretrain on the spot, then rlbus a0/a1 and TRL)
#     pretraining (up to 300 s) and three 120 s budgets outrun one slot: run part 3 twice on the same machine
#     (it stays warm 30 s after a call), first with LEARNING_ARGS="--budget-s 120 --no-trl", then plainly; the
#     second reuses the model and the curves left in $LEARNING_WORK. On a new machine the second call pretrains
#     again and uses the curves only if the weights come out the same (add --deterministic to both calls'
#     LEARNING_ARGS for that: deterministic kernels, 1.8x slower pretraining), else it stops and says so.
#   bash scripts/gpu_acceptance.sh 5   # async_level=1 time-sliced against under MPS (run.gpu_sharing), in turn, 3 pairs
#                                      # (SHARING_VARIANTS, ROUNDS: others, such as run.mps_learner_sm_percent)
#   bash scripts/gpu_acceptance.sh 6   # a decode pass at the learning bench's shape, compiled and recorded
#                                      # (rollout.decode_step), profiled; then the learning bench's async_level=1
#                                      # in each of LEARNING_VARIANTS (default: time-sliced, then under MPS: its
#                                      # 75M decode leaves most SMs idle, where MPS may overlap the update)
#   bash scripts/gpu_acceptance.sh 7   # the decode step compiled in the background (rollout.decode_step=
#                                      # recorded_then_inductor): the GPU decode tests, decode at the learning
#                                      # bench's 75M shape against the compiled step, then the learning bench's
#                                      # async_level=1 in that mode beside TRL (75 s budgets; about 580 s in all)
#   bash scripts/gpu_acceptance.sh 4   # bench/learner.py: rlbus's learner step beside the plain bf16 loop, eager and
#                                      # compiled (LEARNER_CONFIGS picks others)
# Results go to $RESULTS (default ./gpu-results). Needs rlbus installed with its bench extra (trl) on the GPU box.
set -uo pipefail
part=${1:?part 0 to 7}
results=${RESULTS:-./gpu-results}
mkdir -p "$results"
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
date -u +%FT%TZ
stamp() { while IFS= read -r line; do printf '%s %s\n' "$(date +%s.%N | cut -c1-14)" "$line"; done; }
# a variant's overrides (joined by commas) as rlbus-only arguments, in the array `overrides` (parts 5 and 6)
variant_overrides() { overrides=(); for o in ${1//,/ }; do overrides+=(--rlbus-override "$o"); done; }
case $part in
0)
  echo "== make test-gpu"
  timeout 200 "$py" -m pytest -q -m gpu tests -p no:cacheprovider 2>&1 | tail -15
  ;;
1)
  # the plain `rlbus up` first, on the machine as it came (its cold start is what a newcomer meets), then the
  # checkpoint cost (issue 27's figure), then decode
  echo "== plain rlbus up, started at $(date +%s.%N | cut -c1-14)"
  up_dir=$(mktemp -d)
  (cd "$up_dir" && timeout 120 "$py" -m rlbus.cli up trainer.total_training_steps=30 2>&1 | stamp >"$results/up.log")
  grep -E "rlbus:|step +[0-9]+/" "$results/up.log" | head -40
  tar czf "$results/up-logs.tgz" -C "$up_dir/runs/demo" logs  # the services' own logs: where start-up went
  echo "== checkpoint cost, 0.5B shape"
  timeout 200 "$py" bench/checkpoint.py --steps 15 --rounds 3 2>&1 | grep -E "GB of|round|median|memory:|off"
  echo "== decode tokens/s, 0.5B shape, 512 rows x 128 tokens"
  timeout 320 "$py" bench/rollout.py --random-model 896:24:4864 --ignore-eos --engines "${DECODE_ENGINES:-hf,hf-sdpa-decode}" \
    --prompts 64 --n 8 --max-tokens 128 --max-num-seqs 512 --dtype bfloat16 --device cuda --batches 3 \
    --pushes 0 --rounds 2 --profile --json "$results/rollout.json" 2>&1 | grep -v "Loading weights" >"$results/rollout.log"
  grep -E "^(-- |   |engine|hf)" "$results/rollout.log" | grep -vE "^ +(aten|void|Memcpy|cuda|triton|ampere|sm90|Activity)" | tail -16
  echo "== one decode step's attention at that shape, per kernel"
  timeout 120 "$py" bench/decode_attention.py 2>&1 | grep -vi warn
  echo "== the same over a longer cache (1024 response tokens): does the matrix-product decode still win?"
  timeout 120 "$py" bench/decode_attention.py --cache 1056 2>&1 | grep -vi warn
  ;;
2)
  # E2E_VARIANT: rlbus-only overrides joined by commas (such as run.gpu_sharing=mps,run.mps_learner_sm_percent=75)
  variant_overrides "${E2E_VARIANT:-}"
  timeout 570 "$py" bench/e2e_gpu.py --async-levels 0,1 --trl-variants static --rounds 3 --warmup 2 --steps 5 \
    --timeout 240 "${overrides[@]}" 2>&1 | grep -v "Loading weights" | tee "$results/e2e.log" | tail -40
  ;;
3)
  work=${LEARNING_WORK:-/tmp/rlbus-learning}
  timeout "${LEARNING_TIMEOUT:-580}" "$py" bench/learning.py --work "$work" ${LEARNING_ARGS:---budget-s 120} 2>&1 \
    | grep --line-buffered -v "Loading weights" | stamp | tee "$results/learning.log" | grep -v "rlbus up run.id" | tail -30
  cp "$work"/learning.png "$work"/learning.json "$work"/curve-*.json "$work"/learning-a*.log "$results"/ 2>/dev/null
  # each rlbus run's services' logs and metrics: where its start-up and its steps went
  (cd "$work" && tar czf "$results/learning-runs.tgz" runs/*/logs runs/*/metrics.jsonl 2>/dev/null)
  ;;
4)
  # the learner against the hand-written bf16 loop, eager and compiled, MFU against the nominal and measured peak
  timeout 570 "$py" bench/learner.py --warmup 2 --steps 4 --configs "${LEARNER_CONFIGS:-plain-bf16,plain-bf16+compile,rlbus}" \
    --out "$results/learner.json" 2>&1 | grep -v "Loading weights" | tee "$results/learner.log" | tail -20
  ;;
5)
  # one GPU shared by the learner and a replica: the driver's time-slicing against MPS, alternating so that a
  # slow spell of the machine hits both (rlbus only: the sharing is the difference); SHARING_VARIANTS (space-
  # separated, a variant's overrides joined by commas) and ROUNDS pick others
  for round in $(seq 1 "${ROUNDS:-3}"); do
    for variant in ${SHARING_VARIANTS:-run.gpu_sharing=time_slice run.gpu_sharing=mps}; do
      echo "== round $round, $variant"
      variant_overrides "$variant"
      timeout 170 "$py" bench/e2e_gpu.py --async-levels 1 --no-trl --rounds 1 --warmup 2 --steps 5 --timeout 150 \
        "${overrides[@]}" 2>&1 | grep -v "Loading weights" \
        | tee "$results/e2e-${variant//[=,]/-}-$round.log" | grep -E "step [0-9]|^rlbus async_level=1 +[0-9]" | sort -u
    done
  done
  ;;
6)
  # first, where a decode pass at the learning bench's shape spends its time alone (512 rows x 148 tokens),
  # compiled and recorded (rollout.decode_step), each in a process of its own, the recorded one profiled: beside
  # the update it is the larger share of a step
  for engine in hf-recorded hf; do
    timeout 110 "$py" bench/rollout.py --random-model 768:12:2048 --ignore-eos --engines $engine --prompts 64 --n 8 \
      --max-tokens 148 --max-num-seqs 512 --dtype bfloat16 --device cuda --batches 3 --pushes 0 \
      $([ $engine = hf-recorded ] && echo --profile) 2>&1 | grep -v "Loading weights" \
      | tee "$results/rollout-learning-shape-$engine.log" | grep -E "^hf|profiled batch|compiled in|recorded in"
  done
  # then the learning bench's async_level=1 in each variant (space-separated; a variant's overrides joined by
  # commas), on one model
  work=${LEARNING_WORK:-/tmp/rlbus-learning}
  for variant in ${LEARNING_VARIANTS:-run.gpu_sharing=time_slice run.gpu_sharing=mps}; do
    echo "== learning bench, $variant"
    variant_overrides "$variant"
    timeout 290 "$py" bench/learning.py --work "$work" --budget-s 100 --pretrain-s 120 --async-levels 1 --no-trl \
      --micro-batch 512 "${overrides[@]}" 2>&1 | grep -v "Loading weights" \
      | tee "$results/learning-${variant//[=,]/-}.log" | grep -E "^pretrained|^rlbus async_level=1.*: [0-9]|by updates"
  done
  ;;
7)
  timeout 150 "$py" -m pytest -q tests/test_gpu_decode.py -p no:cacheprovider -x 2>&1 | tail -6
  timeout 120 "$py" bench/rollout.py --random-model 768:12:2048 --max-tokens 148 --ignore-eos \
    --engines hf-handover,hf --prompts 64 --n 8 --max-num-seqs 512 --dtype bfloat16 --device cuda --batches 3 \
    --pushes 0 2>&1 | grep -v "Loading weights" | tee "$results/rollout-handover.log" | grep -E "^(-- |   |engine|hf)"
  work=${LEARNING_WORK:-/tmp/rlbus-learning}
  timeout 300 "$py" bench/learning.py --work "$work" --budget-s 75 --pretrain-s 100 --async-levels 1 \
    --micro-batch 512 --rlbus-override rollout.decode_step=recorded_then_inductor 2>&1 | grep -v "Loading weights" \
    | tee "$results/learning-handover.log" | grep -v "rlbus up run.id" | tail -24
  ;;
*)
  echo "unknown part $part (0 to 7)" >&2
  exit 2
  ;;
esac
date -u +%FT%TZ
