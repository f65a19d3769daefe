"""`rlbus train` for preference algorithms: the loop, its metrics and console, the saved model and summary."""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlbus.config import RlbusConfig, save_config
from rlbus.config.schema import PreferenceConfig
from rlbus.learner.checkpoint import (
    CheckpointError,
    checkpoint_root,
    load_checkpoint,
    prune_checkpoints,
    resume_target,
    rewind_metrics,
    save_checkpoint,
    step_dir,
)
from rlbus.learner.dist.context import shutdown
from rlbus.learner.export import save_hf
from rlbus.learner.preference.dataset import (
    iter_batches,
)
from rlbus.learner.preference.trainer import Trainer, _log, build_trainer

SUMMARY_FILE = "preference_summary.json"
MODEL_DIR = "model"


def total_steps(pcfg: PreferenceConfig, n_train: int) -> int:
    per_epoch = math.ceil(n_train / pcfg.batch_size)
    steps = pcfg.epochs * per_epoch
    return min(steps, pcfg.max_steps) if pcfg.max_steps else steps


def progress_line(step: int, total: int, m: dict[str, Any], prefix: str = "train") -> str:
    """What a person watches: loss, the two rewards, their margin and the pairwise accuracy."""

    def f(key: str, fmt: str = "{:.4f}") -> str:
        v = m.get(f"{prefix}/{key}")
        return "-" if v is None else fmt.format(v)

    return (
        f"[{prefix}] step {step}/{total} | loss {f('loss')} | chosen {f('rewards_chosen')} | "
        f"rejected {f('rewards_rejected')} | margin {f('margin')} | acc {f('accuracy', '{:.3f}')}"
    )


def _prefixed(prefix: str, metrics: dict[str, float]) -> dict[str, float]:
    return {f"{prefix}/{k}": v for k, v in metrics.items()}


def fresh_metrics_file(run_dir: Path) -> None:
    """A fresh start under a run id that has metrics moves them aside (not appended to: two step-0 evals
    in one file would make every curve wrong)."""
    from rlbus.metrics_log import METRICS_FILE

    path = run_dir / METRICS_FILE
    if path.exists():
        n = 1
        while (run_dir / f"{METRICS_FILE}.{n}").exists():
            n += 1
        path.rename(run_dir / f"{METRICS_FILE}.{n}")
        _log(f"moved the previous {METRICS_FILE} of run {run_dir.name} to {METRICS_FILE}.{n}")


def check_finite(metrics: dict[str, float], step: int) -> None:
    """Stop at the first NaN/inf: a diverged run must not be saved as if it had trained."""
    for key, value in metrics.items():
        if not math.isfinite(value):
            raise FloatingPointError(f"{key} = {value} at step {step}")


class _Quiet:
    """The metrics writer of ranks > 0: rank 0 alone writes the run's metrics."""

    def log(self, step: int, metrics: dict[str, float]) -> None:
        pass

    def close(self) -> None:
        pass


@dataclass
class LoopState:
    """Where a run is: the steps done and the held-out scores before training (kept by checkpoints)."""

    step: int = 0
    before: dict[str, float] = field(default_factory=dict)


def _save(trainer: Trainer, tokenizer: Any, run_dir: Path, state: LoopState) -> None:
    """A checkpoint of `state.step` (every rank: DCP saves collectively), older ones pruned."""
    cfg = trainer.cfg
    root = checkpoint_root(run_dir, cfg.trainer.default_local_dir)
    extra = {"step": state.step, "before": state.before, "run_id": cfg.run.id}
    save_checkpoint(step_dir(root, state.step), trainer, extra, tokenizer)
    if trainer.ctx.is_leader:
        prune_checkpoints(root, cfg.trainer.max_ckpt_to_keep)


def _resume(trainer: Trainer, run_dir: Path) -> LoopState:
    """The latest checkpoint of this run (`trainer.resume_mode`), or a fresh start with the previous
    metrics moved aside."""
    cfg = trainer.cfg
    path = resume_target(run_dir, cfg.trainer.resume_mode, None, cfg.trainer.default_local_dir)
    if path is None:
        if trainer.ctx.is_leader:
            fresh_metrics_file(run_dir)
        return LoopState()
    extra = load_checkpoint(path, trainer)
    state = LoopState(int(extra["step"]), dict(extra.get("before") or {}))
    if trainer.ctx.is_leader:
        rewind_metrics(run_dir, state.step)
    _log(f"resumed from {path} at step {state.step}")
    return state


def train_loop(
    trainer: Trainer, writer: Any, steps: int, console: bool, state: LoopState, save: Any = None
) -> tuple[dict, dict, int]:
    """Eval, `steps` optimizer steps (epochs reshuffled, the first `state.step` skipped), eval; returns
    (eval before, eval after, steps done). `save()` runs every `trainer.save_freq` steps."""
    cfg, pcfg = trainer.cfg, trainer.pcfg

    def evaluate(step: int) -> dict[str, float]:
        m = _prefixed("eval", trainer.evaluate())
        writer.log(step, m)
        if console:
            print(progress_line(step, steps, m, "eval"), flush=True)
        return m

    if not state.before:
        state.before = evaluate(0)
    step, t0, resumed_at = 0, time.perf_counter(), state.step
    for epoch in range(pcfg.epochs):
        for batch in iter_batches(
            trainer.train_size(), pcfg.batch_size, shuffle=True, seed=pcfg.seed, epoch=epoch
        ):
            if step >= steps:
                break
            step += 1
            if step <= resumed_at:  # trained before the checkpoint: same order, so the same batches
                continue
            m = _prefixed("train", trainer.step(batch))
            m.update(
                {"train/epoch": float(epoch), "perf/step_s": (time.perf_counter() - t0) / (step - resumed_at)}
            )
            check_finite(m, step)
            writer.log(step, m)
            if console and (step % pcfg.log_every == 0 or step == steps):
                print(progress_line(step, steps, m), flush=True)
            if cfg.trainer.test_freq > 0 and step % cfg.trainer.test_freq == 0 and step < steps:
                evaluate(step)
            state.step = step
            if save is not None and cfg.trainer.save_freq > 0 and step % cfg.trainer.save_freq == 0:
                save()
    return state.before, evaluate(step), step


def train_preference(cfg: RlbusConfig) -> dict[str, Any]:
    """The whole offline run; returns the summary also written to `<run dir>/preference_summary.json`.

    Under `torchrun` every rank runs this; rank 0 writes the metrics, the console, the summary and the
    files, and every rank takes part in the collectives (FSDP2, checkpoints, the final gather). The
    process group (or the one-process context) it sets up is torn down when it returns."""
    try:
        return _train_preference(cfg)
    finally:
        shutdown()


def _train_preference(cfg: RlbusConfig) -> dict[str, Any]:
    from rlbus.metrics_log import MetricsWriter

    pcfg = cfg.preference
    run_dir = Path(cfg.run.dir) / cfg.run.id
    run_dir.mkdir(parents=True, exist_ok=True)
    trainer, tokenizer = build_trainer(cfg, run_dir, lambda n: total_steps(pcfg, n))
    leader = trainer.ctx.is_leader
    if leader:
        save_config(cfg, run_dir / "config.yaml")
    steps = total_steps(pcfg, trainer.train_size())
    state = _resume(trainer, run_dir)
    loggers = [x for x in cfg.trainer.logger if x != "console"]  # its RL progress line does not fit here
    writer = (
        MetricsWriter(run_dir, loggers, steps, cfg.trainer.project_name, cfg.trainer.experiment_name)
        if leader
        else _Quiet()
    )
    try:
        before, after, done = train_loop(
            trainer,
            writer,
            steps,
            leader and "console" in cfg.trainer.logger,
            state,
            save=lambda: _save(trainer, tokenizer, run_dir, state),
        )
    finally:
        writer.close()
    summary: dict[str, Any] = {"algorithm": pcfg.algorithm, "steps": done, "before": before, "after": after}
    summary["ranks"] = trainer.ctx.world_size
    if pcfg.save_model:
        out = save_hf(trainer.model, tokenizer, run_dir / MODEL_DIR)  # LoRA: merged, under the base names
        summary["model_dir"] = str(out)
        _log(f"saved the trained model to {out}")
    if leader:
        (run_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
    nan = float("nan")
    _log(
        f"held-out margin {before.get('eval/margin', nan):.4f} -> {after.get('eval/margin', nan):.4f}, "
        f"accuracy {before.get('eval/accuracy', nan):.3f} -> {after.get('eval/accuracy', nan):.3f}"
    )
    return summary


def run_preference(cfg: RlbusConfig) -> int:
    """`rlbus train` entry: 0 when trained (and saved); data and config problems print one line and give 2,
    a diverged run (NaN/inf) gives 1, without a traceback a user has to read through."""
    try:
        train_preference(cfg)
    except (ValueError, FileNotFoundError, TimeoutError, CheckpointError) as exc:
        _log(f"error: {exc}")
        return 2
    except FloatingPointError as exc:
        _log(f"diverged: {exc}")
        return 1
    return 0
