"""`rlbus plot RUN_DIR`: training curves from a run's metrics.jsonl as one PNG (matplotlib, Agg backend).

Panels, each drawn only when its metric was logged: reward mean, accuracy (sampled
`reward/accuracy` as a line, held-out greedy `val/accuracy` as points), KL, response length and
throughput. The figure lands in `<run_dir>/plots/curves.png` unless `out` says otherwise.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from rlbus.metrics_log import METRICS_FILE

FIGURE_NAME = "curves.png"
KL_KEYS = ("actor/kl", "actor/kl_loss", "reward/kl")
"""KL to the reference policy: the first of these that a run logged (only runs with a KL term do)."""


class PlotError(ValueError):
    """Nothing to plot: the metrics file is missing, empty or holds no known metric."""


def _metrics_path(run_dir: str | Path) -> Path:
    path = Path(run_dir)
    return path if path.suffix == ".jsonl" else path / METRICS_FILE


def load_rows(run_dir: str | Path) -> list[dict[str, Any]]:
    """Rows of metrics.jsonl; a torn last line (the run is still writing) is skipped."""
    path = _metrics_path(run_dir)
    if not path.is_file():
        raise PlotError(
            f"no metrics file at {path} (is {Path(run_dir)} a run directory? runs write "
            f"{METRICS_FILE} when trainer.logger includes jsonl)"
        )
    rows = []
    lines = path.read_text(errors="replace").splitlines()
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            if n == len(lines):
                continue  # the writer is mid-line
            raise PlotError(f"{path}:{n} is not JSON: {exc}") from exc
        if isinstance(row, dict) and "step" in row:
            rows.append(row)
    if not rows:
        raise PlotError(f"{path} has no metrics rows yet (empty file): nothing to plot")
    return rows


def series(rows: list[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    """(steps, values) of one metric, skipping rows without it and non-finite values."""
    xs, ys = [], []
    for row in rows:
        value = row.get(key)
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            continue
        xs.append(float(row["step"]))
        ys.append(float(value))
    return xs, ys


def _kl_key(rows: list[dict[str, Any]]) -> str | None:
    for key in KL_KEYS:
        _, ys = series(rows, key)
        if ys:
            return key
    return None


def _output_path(run_dir: str | Path, out: str | Path | None) -> Path:
    if out is None:
        base = Path(run_dir)
        base = base.parent if base.suffix == ".jsonl" else base
        return base / "plots" / FIGURE_NAME
    out = Path(out)
    return out if out.suffix.lower() == ".png" else out / FIGURE_NAME


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> list[Path]:
    """Write the curves PNG for a run; returns the written paths. Raises PlotError when there is nothing."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    rows = load_rows(run_dir)
    panels: list[tuple[str, list[tuple[str, str]]]] = []  # (title, [(key, style)])
    if series(rows, "reward/mean")[1]:
        panels.append(("reward (mean)", [("reward/mean", "line")]))
    acc = [(k, s) for k, s in (("reward/accuracy", "line"), ("val/accuracy", "points")) if series(rows, k)[1]]
    if acc:
        panels.append(("accuracy", acc))
    kl = _kl_key(rows)
    if kl:
        panels.append((f"KL ({kl})", [(kl, "line")]))
    if series(rows, "response/length_mean")[1]:
        panels.append(("response length (tokens)", [("response/length_mean", "line")]))
    if series(rows, "perf/tokens_per_s")[1]:
        panels.append(("throughput (tokens/s)", [("perf/tokens_per_s", "line")]))
    if not panels:
        raise PlotError(
            f"{_metrics_path(run_dir)} has {len(rows)} rows but none of reward/mean, "
            "reward/accuracy, val/accuracy, KL, response/length_mean, perf/tokens_per_s"
        )

    cols = 2 if len(panels) > 1 else 1
    nrows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(6.0 * cols, 3.4 * nrows), squeeze=False)
    try:
        for ax, (title, keys) in zip(axes.flat, panels, strict=False):
            for key, style in keys:
                xs, ys = series(rows, key)
                if style == "points":
                    ax.plot(xs, ys, "o", color="tab:red", markersize=6, label=key)
                else:
                    ax.plot(xs, ys, "-", linewidth=1.4, label=key)
            ax.set_title(title)
            ax.set_xlabel("step")
            ax.grid(True, alpha=0.3)
            if len(keys) > 1:
                ax.legend(loc="best", fontsize=8)
        for ax in list(axes.flat)[len(panels) :]:
            ax.set_visible(False)
        last = rows[-1]
        fig.suptitle(f"{Path(run_dir).name}: {len(rows)} rows, last step {int(last['step'])}", fontsize=10)
        fig.tight_layout()
        path = _output_path(run_dir, out)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=100)
    finally:
        plt.close(fig)
    return [path]


__all__ = ["PlotError", "load_rows", "plot_run", "series"]
