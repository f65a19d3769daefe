"""The benchmarks run on the CPU box as shipped (make test-slow): `bench/learner.py --tiny` with its default
configs (those needing a GPU extra are skipped with the reason, not a crash), `bench/rollout.py` with the
embedded engine's five decode paths, `bench/checkpoint.py --tiny` with the memory checkpoint alone and with the
rolling one, `bench/decode_attention.py` with each attention kernel against the math one, `bench/bus.py` on a short
setting with 1 and 2 partitions side by side, `bench/reward_function.py` with its four ways to the reward sandbox,
`bench/decode_beside_python.py`, and `bench/learning.py --tiny` (a model pretrained on the spot
whose held-out accuracy GRPO through `rlbus up` raises). Speed figures are not checked here; the benches
print them."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_bench(args: list[str], timeout: int) -> subprocess.CompletedProcess[str]:
    """`python <args>` in the repository root, its output captured."""
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_learner_bench_runs_its_default_configs_on_cpu() -> None:
    done = run_bench(
        ["bench/learner.py", "--tiny", "--steps", "1", "--warmup", "1", "--device", "cpu"], timeout=580
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    rows = {line.split()[0] for line in done.stdout.splitlines() if re.match(r"^\S+\s+sdpa\s", line)}
    assert {"plain-bf16", "plain-bf16+compile", "rlbus", "rlbus+pack", "rlbus/var"} <= rows, done.stdout
    if importlib.util.find_spec("liger_kernel") is None:
        assert "skipping rlbus+liger: it needs liger-kernel" in done.stdout
    assert "rlbus+liger" not in rows


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_bus_bench_reports_every_figure_for_each_partition_count() -> None:
    done = run_bench(["bench/bus.py", "--partitions", "1,2", "--rates", "40", "--seconds", "2"], timeout=280)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    side_by_side = done.stdout.split("# side by side", 1)[1]
    assert re.search(r"partitions 1, .* achieved +[\d.]+ \([\d.]+\)", side_by_side), side_by_side
    assert re.search(r"partitions 2, .* achieved +[\d.]+ \([\d.]+\)", side_by_side), side_by_side
    for figure in ("replica -> ready stored", "ready stored -> learner", "CPU ms per group", "H200 step"):
        assert side_by_side.count(figure) == 2, figure


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_reward_function_bench_times_each_way_to_the_sandbox() -> None:
    done = run_bench(["bench/reward_function.py", "--groups", "4", "--n", "4", "--rounds", "1"], timeout=110)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    for way in ("file loaded per call", "a round trip per response", "a round trip per group", "per chunk"):
        assert re.search(rf"{way} .* [\d.]+ ms +\d+ responses/s", done.stdout), done.stdout
    assert re.search(r"per group vs per response: [\d.]+x; vs loaded per call: [\d.]+x", done.stdout), (
        done.stdout
    )
    assert re.search(r"per chunk vs per group: [\d.]+x", done.stdout), done.stdout


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_rollout_bench_compares_the_embedded_engine_with_its_other_decode_paths(
    tmp_path: Path,
) -> None:
    out = tmp_path / "rollout.json"
    done = run_bench(
        [
            "bench/rollout.py",
            "--random-model",
            "64:2:128",
            "--ignore-eos",
            "--engines",
            "hf,hf-unfused,hf-sdpa-decode,hf-unplanned,hf-eager",
            "--prompts",
            "3",
            "--n",
            "2",
            "--max-tokens",
            "6",
            "--batches",
            "1",
            "--pushes",
            "0",
            "--rounds",
            "2",
            "--json",
            str(out),
        ],
        timeout=280,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    results = json.loads(out.read_text())["results"]
    assert set(results) == {"hf", "hf-unfused", "hf-sdpa-decode", "hf-unplanned", "hf-eager"}
    assert all(len(r["tokens_per_s_rounds"]) == 2 for r in results.values()), results
    started = re.findall(r"^-- (\S+)", done.stdout, re.MULTILINE)  # the second round runs them in reverse
    assert started[5:] == started[:5][::-1] and started[0] == "hf", started
    assert all(r["mean_len"] == 6 and r["tokens_per_s"] > 0 for r in results.values()), results
    assert re.search(r"hf/hf-unplanned tokens/s ratio: [\d.]+x", done.stdout), done.stdout
    assert re.search(r"hf/hf-sdpa-decode tokens/s ratio: [\d.]+x", done.stdout), done.stdout


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_checkpoint_bench_times_the_memory_checkpoint_alone_and_with_the_rolling_one(
    tmp_path: Path,
) -> None:
    done = run_bench(
        [
            "bench/checkpoint.py",
            "--tiny",
            "--device",
            "cpu",
            "--steps",
            "2",
            "--rounds",
            "1",
            "--shm",
            str(tmp_path / "shm"),
            "--dir",
            str(tmp_path),
        ],
        timeout=280,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    for side in ("memory", "memory+rolling"):
        assert re.search(
            rf"^{re.escape(side)}: per round [\d.]+ of the round's plain step; median [\d.]+x .*"
            rf"all rounds together [\d.]+x",
            done.stdout,
            re.M,
        ), done.stdout
    assert re.search(r"memory: per step commit_s [\d.]+ ms, state_s", done.stdout), done.stdout
    assert "round 1 memory: mean step" in done.stdout and "2 memory checkpoints" in done.stdout
    assert re.search(
        r"^round 1 plain: mean step [\d.]+ s before the sides, [\d.]+ s after", done.stdout, re.M
    )


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_the_learning_bench_pretrains_a_model_that_rlbus_then_improves(tmp_path: Path) -> None:
    done = run_bench(
        [
            "bench/learning.py",
            "--tiny",
            "--no-trl",
            "--async-levels",
            "1",
            "--work",
            str(tmp_path),
        ],
        timeout=380,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    summary = json.loads((tmp_path / "learning.json").read_text())
    assert summary["pretrained"]["val_greedy"] >= 0.4, summary["pretrained"]  # pretraining reached its stop
    curve = summary["curves"]["rlbus async_level=1"]
    start = curve["points"][0][1]
    # rlbus's first validation is the pretrained model's (its engine pads a batch; the pretraining did not)
    assert abs(start - summary["pretrained"]["val_greedy"]) <= 0.05, (start, summary["pretrained"])
    assert len(curve["points"]) >= 4 and curve["gain"] >= 0.1, curve  # held-out accuracy rose under GRPO
    assert (tmp_path / "learning.png").stat().st_size > 10_000


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_decode_attention_bench_times_each_kernel_against_the_math_one() -> None:
    done = run_bench(
        ["bench/decode_attention.py", "--device", "cpu", "--rows", "8", "--iters", "2"], timeout=280
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    timed = dict(re.findall(r"^  (.+?) +[\d.]+ us a call +max \|diff\| vs math (\S+)$", done.stdout, re.M))
    assert set(timed) == {
        "sdpa (its own pick)",
        "explicit",
        "flex, folded",
        "flex, grouped heads",
        "sdpa math",
    }, done.stdout
    assert all(float(diff) < 1e-5 for diff in timed.values()), timed


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_decode_beside_python_bench_times_the_loop_alone_and_at_each_switch_interval() -> None:
    done = run_bench(["bench/decode_beside_python.py", "--batches", "1"], timeout=280)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert re.search(r"^ +alone: +[\d.]+ ms a batch$", done.stdout, re.M), done.stdout
    intervals = re.findall(r"^beside a Python thread, +(\S+) ms: +[\d.]+ ms a batch \([\d.]+x alone\)$",
                           done.stdout, re.M)  # fmt: skip
    assert intervals == ["5", "1", "0.1"], done.stdout
