"""Per-step metrics sinks: a console progress line, a JSONL file and TensorBoard (wandb when asked)."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rlbus.verl_metric_names import is_validation_row, with_verl_names

METRICS_FILE = "metrics.jsonl"


def progress_line(step: int, total: int | None, m: dict[str, Any]) -> str:
    """The one line a person watches. First the fields of the users' guide (Loss, PPO KL between the
    updated and the behaving policy, mean Reward, Throughput in samples/s), then ours: accuracy,
    held-out accuracy, KL to the reference, response length, tokens/s, policy lag, dropped work."""

    def f(*keys: str, fmt: str = "{:.3f}") -> str:
        for key in keys:
            v = m.get(key)
            if v is not None and not (isinstance(v, float) and math.isnan(v)):
                return fmt.format(v)
        return "-"

    total_s = f"/{total}" if total else ""
    return (
        f"step {step}{total_s} | Loss {f('actor/loss', fmt='{:.4f}')} | "
        f"PPO KL {f('actor/approx_kl', 'actor/ppo_kl', fmt='{:.4f}')} | Reward {f('reward/mean')} | "
        f"Throughput {f('perf/samples_per_s', fmt='{:.1f}')} samples/s | acc {f('reward/accuracy')} | "
        f"val {f('val/accuracy')} | kl {f('actor/kl', fmt='{:.4f}')} | "
        f"len {f('response/length_mean', fmt='{:.1f}')} | tok/s {f('perf/tokens_per_s', fmt='{:.0f}')} | "
        f"lag {f('staleness/mean', fmt='{:.2f}')} | dropped {f('staleness/dropped_total', fmt='{:.0f}')} | "
        f"reward err {f('reward/error_rate', fmt='{:.2f}')}"
    )


def tensorboard_dir(run_dir: Path, project: str, experiment: str) -> Path:
    """verl's place when TENSORBOARD_DIR is set (<TENSORBOARD_DIR>/<project>/<experiment>), else the run's."""
    root = os.environ.get("TENSORBOARD_DIR")
    return Path(root) / project / experiment if root else Path(run_dir) / "tensorboard"


class MetricsWriter:
    def __init__(
        self,
        run_dir: Path,
        loggers: Sequence[str],
        total_steps: int | None = None,
        project: str = "rlbus",
        experiment: str = "run",
    ) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.loggers = set(loggers)
        self.total_steps = total_steps
        self._jsonl = open(self.run_dir / METRICS_FILE, "a") if "jsonl" in self.loggers else None  # noqa: SIM115
        self._tb = None
        if "tensorboard" in self.loggers:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(tensorboard_dir(self.run_dir, project, experiment)))
        self._wandb = None
        if "wandb" in self.loggers:
            import wandb  # optional; only when the user asked for it

            self._wandb = wandb.init(project=project, name=experiment, dir=str(self.run_dir))

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        clean = {
            k: (float(v) if isinstance(v, int | float) else v) for k, v in with_verl_names(metrics).items()
        }
        if self._jsonl:
            self._jsonl.write(json.dumps({"step": step, "time": time.time(), **clean}) + "\n")
            self._jsonl.flush()
        if self._tb:
            for k, v in clean.items():
                if isinstance(v, float) and math.isfinite(v):
                    self._tb.add_scalar(k, v, step)
            self._tb.flush()
        if self._wandb:
            self._wandb.log(clean, step=step)
        if "console" in self.loggers and not is_validation_row(clean):
            print(progress_line(step, self.total_steps, clean), file=sys.stdout, flush=True)

    def close(self) -> None:
        if self._jsonl:
            self._jsonl.close()
        if self._tb:
            self._tb.close()
        if self._wandb:
            self._wandb.finish()


class MetricsTail:
    """The rows appended to a run's metrics.jsonl since the last call, reading only the new bytes (the
    launcher asks every second; re-reading the whole file would cost O(steps) each time).

    A resumed learner rewrites the file up to its checkpoint (`rewind_metrics`: a new file in its place)
    and appends again, possibly past where we had read before we look: a rewritten file (another inode,
    or a shorter one) is read again from its start, and rows already returned are skipped.
    """

    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / METRICS_FILE
        self.offset = 0
        self._partial = b""  # a row still being written
        self._file: tuple[int, int] | None = None  # (device, inode) being read
        self._seen: set[int] = set()  # hashes of the rows returned

    def new_rows(self) -> list[dict[str, Any]]:
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return []
        if (st.st_dev, st.st_ino) != self._file or st.st_size < self.offset:
            self._file, self.offset, self._partial = (st.st_dev, st.st_ino), 0, b""
        with open(self.path, "rb") as fh:
            fh.seek(self.offset)
            data = fh.read(max(0, st.st_size - self.offset))
        self.offset += len(data)
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()
        rows = []
        for line in lines:
            key = hash(line)
            if not line.strip() or key in self._seen:
                continue
            try:
                rows.append(json.loads(line))
            except ValueError:  # cut short by a killed writer (rewind_metrics drops it from the file)
                continue
            self._seen.add(key)
        return rows


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / METRICS_FILE
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
