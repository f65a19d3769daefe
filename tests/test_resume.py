"""Kill the learner after a checkpoint, restart it with resume_mode=auto: the run continues from the saved
step with the same data order, trains no step twice and ends with the weights of an uninterrupted run.

Real NATS, the services as separate OS processes. Deterministic by construction: async_level=0 (exactly
on-policy), rollout.seed_per_prompt (a prompt's samples depend on its data index and the weights only),
batches trained in data order.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from e2e_utils import Run, make_config

from rlbus.learner.checkpoint import SUPERSEDED_METRICS, checkpoint_root, checkpoint_step, latest_checkpoint
from rlbus.learner.memory_checkpoint import default_directory, find_memory_checkpoint

STEPS, SAVE_FREQ, BATCH = 8, 3, 4
COMMON = [
    "trainer.async_level=0",
    "rollout.replicas=1",
    f"trainer.total_training_steps={STEPS}",
    f"data.train_batch_size={BATCH}",
    "rollout.n=4",
    "rollout.prompts_per_batch=4",
    "rollout.seed_per_prompt=true",
    f"trainer.save_freq={SAVE_FREQ}",
    "trainer.max_ckpt_to_keep=2",
    "trainer.test_freq=-1",
    "trainer.val_before_train=false",
    "actor.optim.lr=1e-3",
    "trainer.seed=7",
    "trainer.resume_mode=auto",
]


def _indices_per_step(ledger: dict) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for pid, step in ledger["trained"].items():
        out.setdefault(int(step), []).append(int(ledger["dispatched"][pid]))
    return {s: sorted(v) for s, v in sorted(out.items())}


def _final_weights(run: Run) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(run.run_dir / "final" / "model.safetensors"))


def _train_rows(run: Run) -> list[dict]:
    return [r for r in run.metrics() if "actor/loss" in r]


def _delete_run(url: str, run_id: str) -> None:
    from rlbus.bus import Bus
    from rlbus.config.schema import RlbusConfig

    async def go() -> None:
        bus = await Bus.open(
            RlbusConfig(run={"id": run_id}, bus={"url": url}), name="test-cleanup", ensure=False
        )
        try:
            await bus.delete_run()
        finally:
            await bus.close()

    with contextlib.suppress(Exception):
        asyncio.run(asyncio.wait_for(go(), 15))


def _kill_after_a_checkpoint(
    run: Run, root: Path, also: Callable[[int], bool] = lambda saved: True
) -> tuple[int, int]:
    """SIGKILL the learner once a checkpoint exists and at least one more step is done (work to redo), and
    `also(its step)` holds."""
    deadline = time.monotonic() + 180
    while True:
        ckpt = latest_checkpoint(root)
        rows = _train_rows(run)
        if (
            ckpt is not None
            and rows
            and rows[-1]["step"] > checkpoint_step(ckpt)
            and also(checkpoint_step(ckpt))
        ):
            break
        assert run.learner.alive, run.logs("learner")
        assert time.monotonic() < deadline, run.logs("learner")
        time.sleep(0.05)
    assert run.learner.proc is not None
    run.learner.proc.send_signal(signal.SIGKILL)
    run.learner.proc.wait(10)
    return checkpoint_step(ckpt), _train_rows(run)[-1]["step"]


@pytest.mark.timeout(420)
@pytest.mark.parametrize(
    "mode",
    # make test keeps save_freq's variant; the others (20-25 s each on 2 cores) run in make test-slow
    ["save_freq", *(pytest.param(m, marks=pytest.mark.slow) for m in ("rolling", "memory", "memory_lost"))],
)
def test_killed_learner_resumes_to_the_weights_of_an_uninterrupted_run(
    nats_url: str, run_id: str, tmp_path: Path, mode: str
) -> None:
    """From a save_freq checkpoint, from the rolling one of the newest step (written in the background,
    rlbus.learner.rolling_checkpoint), or from the memory one of every step (rlbus.learner.memory_checkpoint;
    or, when the memory one's slot is gone, from the rolling one staged from the memory checkpointer's copy):
    each way the resumed run ends with the uninterrupted run's weights."""
    t0 = time.monotonic()
    run_b = f"{run_id}b"
    shm = tmp_path / "shm"
    common = [
        *COMMON,
        f"trainer.rolling_checkpoint_budget={0.05 if mode in ('rolling', 'memory_lost') else 0}",
        f"trainer.memory_checkpoint={'on' if mode.startswith('memory') else 'off'}",
        f"trainer.memory_checkpoint_dir={shm}",
    ]
    try:  # A (uninterrupted) and B (killed, resumed) side by side: they share nothing but the NATS server
        with (
            Run(make_config(nats_url, run_id, tmp_path, common)) as a,
            Run(make_config(nats_url, run_b, tmp_path, common)) as b,
        ):
            slots = default_directory(shm, b.run_dir, run_b)

            def memory_ahead(saved: int) -> bool:  # memory_lost: a memory step newer than the disk one
                found = find_memory_checkpoint(slots, b.run_dir)
                return mode != "memory_lost" or (found is not None and found.step > saved)

            saved, done_at_kill = _kill_after_a_checkpoint(b, checkpoint_root(b.run_dir), memory_ahead)
            memory = find_memory_checkpoint(slots, b.run_dir)
            if mode == "memory":  # the step whose row was logged, or the one before (killed in between)
                assert memory is not None
                saved = memory.step
                assert 0 <= done_at_kill - saved <= 1, (saved, done_at_kill)
            elif mode == "memory_lost":  # its slot gone: the disk checkpoint, said on the learner's log
                assert memory is not None and memory.step > saved
                (memory.directory / f"slot{memory.record['slot']}.bin").unlink()
            elif (
                mode == "rolling"
            ):  # the step in flight is all a restart redoes (or two: the kill hit a write)
                assert 1 <= done_at_kill - saved <= 2, (saved, done_at_kill)
            else:
                assert saved in (SAVE_FREQ, 2 * SAVE_FREQ) and done_at_kill > saved
            b.learner.start()  # same config: trainer.resume_mode=auto
            assert a.wait_learner(240) == 0, a.logs("learner")
            assert b.wait_learner(240) == 0, b.logs("learner")
            log = b.proc("learner").log_path.read_text()
            if mode == "memory_lost":
                assert "memory checkpoint unusable" in log
    finally:
        _delete_run(nats_url, run_b)
    t_total = time.monotonic() - t0

    assert (
        "resumed from checkpoint" in log and f"step={saved}" in log.split("resumed from checkpoint")[1][:400]
    )
    # Every step exactly once in metrics.jsonl; the crashed attempt's later rows were moved aside.
    rows_b, rows_a = _train_rows(b), _train_rows(a)
    assert [r["step"] for r in rows_b] == list(range(1, STEPS + 1))
    moved = b.run_dir / SUPERSEDED_METRICS  # none when the kill lost no step
    superseded = (
        [json.loads(line)["step"] for line in moved.read_text().splitlines()] if moved.exists() else []
    )
    assert superseded == list(range(saved + 1, done_at_kill + 1))
    assert rows_b[saved]["time"] > rows_b[saved - 1]["time"]
    # Same data order: the same data indices trained in each step; none twice.
    ledger_a, ledger_b = a.ledger(), b.ledger()
    order_a, order_b = _indices_per_step(ledger_a), _indices_per_step(ledger_b)
    assert order_b == order_a and sorted(order_a) == list(range(STEPS))
    assert all(len(v) == BATCH for v in order_b.values())
    trained_idx = [ledger_b["dispatched"][p] for p in ledger_b["trained"]]
    assert max(Counter(trained_idx).values()) == 1, "a data index was trained twice"
    assert set(ledger_b["dispatched"]) == set(ledger_b["trained"]) | set(ledger_b["dropped"])
    assert all(p.startswith(f"{run_b}-a1-") for p, s in ledger_b["trained"].items() if s >= saved)
    # The same updates: per-step losses and rewards, then the final weights.
    for ra, rb in zip(rows_a, rows_b, strict=True):
        assert rb["reward/mean"] == ra["reward/mean"], ra["step"]
        assert rb["actor/pg_loss"] == pytest.approx(ra["actor/pg_loss"], abs=1e-6), ra["step"]
        assert rb["policy/version"] == ra["policy/version"]
    wa, wb = _final_weights(a), _final_weights(b)
    assert wa.keys() == wb.keys()
    worst = max(float((wa[k] - wb[k]).abs().max()) for k in wa)
    assert worst <= 1e-6, f"final weights differ by {worst}"
    base = _final_weights_base()
    assert max(float((wa[k] - base[k]).abs().max()) for k in wa if k in base) > 1e-4, (
        "training moved the weights"
    )
    assert sorted(p.name for p in checkpoint_root(b.run_dir).iterdir()) == ["global_step_6", "global_step_8"]
    assert not any(shm.glob("rlbus-*")), "a finished run leaves its memory slots behind"
    print(
        f"\nboth runs {t_total:.0f}s, killed after step {done_at_kill} "
        f"(checkpoint {saved}), max weight diff {worst:.2e}, leftovers acked {ledger_b.get('leftovers')}"
    )


def _final_weights_base() -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    from rlbus.tiny_model import default_model_path

    return load_file(str(default_model_path() / "model.safetensors"))


@pytest.mark.timeout(300)
def test_resume_with_work_in_flight_trains_no_index_twice(nats_url: str, run_id: str, tmp_path: Path) -> None:
    """async_level=1: prompts are in flight at every checkpoint. The resumed learner drops them ('resumed'),
    dispatches their data indices again under new ids, and acks whatever the crashed attempt made as
    leftovers: every index is trained at most once and the ledger adds up."""
    steps = 6
    cfg = make_config(
        nats_url,
        run_id,
        tmp_path,
        [
            "trainer.async_level=1",
            "rollout.replicas=1",
            f"trainer.total_training_steps={steps}",
            "data.train_batch_size=4",
            "rollout.n=4",
            "rollout.prompts_per_batch=2",
            "trainer.save_freq=2",
            "trainer.test_freq=-1",
            "trainer.val_before_train=false",
            "trainer.resume_mode=auto",
        ],
    )
    with Run(cfg) as run:
        saved, done_at_kill = _kill_after_a_checkpoint(run, checkpoint_root(run.run_dir))
        run.learner.start()
        assert run.wait_learner(240) == 0, run.logs("learner")
        ledger = run.ledger()
    rows = _train_rows(run)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    trained, dropped, dispatched = ledger["trained"], ledger["dropped"], ledger["dispatched"]
    assert set(dispatched) == set(trained) | set(dropped) and not set(trained) & set(dropped)
    assert Counter(int(s) for s in trained.values()) == {s: 4 for s in range(steps)}, "each step once, full"
    trained_idx = Counter(dispatched[p] for p in trained)
    assert max(trained_idx.values()) == 1, "a data index was trained twice"
    resumed = [p for p, why in dropped.items() if why == "resumed"]
    assert resumed, "work was in flight at the checkpoint"
    again = {dispatched[p] for p in dispatched if p.startswith(f"{run_id}-a1-")}
    assert {dispatched[p] for p in resumed} <= again, "in-flight indices are dispatched again"
    assert all(s < saved for p, s in trained.items() if not p.startswith(f"{run_id}-a1-"))
