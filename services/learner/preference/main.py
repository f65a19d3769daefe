"""`rlbus train` for preference algorithms: the loop, its metrics and console, the saved model and summary."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from rlbus.config import RlbusConfig, save_config
from rlbus.config.schema import PreferenceConfig
from rlbus.learner.preference.dataset import (
    iter_batches,
)
from rlbus.learner.preference.trainer import Trainer, _log, build_trainer

SUMMARY_FILE = "preference_summary.json"
MODEL_DIR = "model"


def is_preference_run(cfg: RlbusConfig) -> bool:
    """`rlbus train` dispatches here instead of starting the RL services when an algorithm is chosen."""
    return cfg.preference.algorithm != "none"


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
    """A preference run never resumes, so an earlier run's metrics under the same run id are moved aside
    (not appended to: two step-0 evals in one file would make every curve wrong)."""
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


def train_loop(trainer: Trainer, writer: Any, steps: int, console: bool) -> tuple[dict, dict, int]:
    """Eval, `steps` optimizer steps (epochs reshuffled), eval; returns (eval before, eval after, steps done)."""
    cfg, pcfg = trainer.cfg, trainer.pcfg

    def evaluate(step: int) -> dict[str, float]:
        m = _prefixed("eval", trainer.evaluate())
        writer.log(step, m)
        if console:
            print(progress_line(step, steps, m, "eval"), flush=True)
        return m

    before = evaluate(0)
    step, t0 = 0, time.perf_counter()
    for epoch in range(pcfg.epochs):
        for batch in iter_batches(
            trainer.train_size(), pcfg.batch_size, shuffle=True, seed=pcfg.seed, epoch=epoch
        ):
            if step >= steps:
                break
            step += 1
            m = _prefixed("train", trainer.step(batch))
            m.update({"train/epoch": float(epoch), "perf/step_s": (time.perf_counter() - t0) / step})
            check_finite(m, step)
            writer.log(step, m)
            if console and (step % pcfg.log_every == 0 or step == steps):
                print(progress_line(step, steps, m), flush=True)
            if cfg.trainer.test_freq > 0 and step % cfg.trainer.test_freq == 0 and step < steps:
                evaluate(step)
    return before, evaluate(step), step


def train_preference(cfg: RlbusConfig) -> dict[str, Any]:
    """The whole offline run; returns the summary also written to `<run dir>/preference_summary.json`."""
    from rlbus.metrics_log import MetricsWriter

    pcfg = cfg.preference
    run_dir = Path(cfg.run.dir) / cfg.run.id
    run_dir.mkdir(parents=True, exist_ok=True)
    save_config(cfg, run_dir / "config.yaml")
    trainer, tokenizer = build_trainer(cfg, run_dir)
    steps = total_steps(pcfg, trainer.train_size())
    fresh_metrics_file(run_dir)
    loggers = [x for x in cfg.trainer.logger if x != "console"]  # its RL progress line does not fit here
    writer = MetricsWriter(run_dir, loggers, steps, cfg.trainer.project_name, cfg.trainer.experiment_name)
    try:
        before, after, done = train_loop(trainer, writer, steps, "console" in cfg.trainer.logger)
    finally:
        writer.close()
    summary: dict[str, Any] = {"algorithm": pcfg.algorithm, "steps": done, "before": before, "after": after}
    if pcfg.save_model:
        out = run_dir / MODEL_DIR
        trainer.model.save_pretrained(str(out))
        tokenizer.save_pretrained(str(out))
        summary["model_dir"] = str(out)
        _log(f"saved the trained model to {out}")
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
    except (ValueError, FileNotFoundError, TimeoutError) as exc:
        _log(f"error: {exc}")
        return 2
    except FloatingPointError as exc:
        _log(f"diverged: {exc}")
        return 1
    return 0
