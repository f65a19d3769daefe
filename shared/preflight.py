"""What `rlbus up` and `rlbus check` verify before any service starts, so a start-up failure is one line on
the console naming its key, not five restarts and "see runs/.../logs/rollout-0.log".

Checked: every model the run loads (a directory with a config.json, or a hub id already in the local
Hugging Face cache: replicas do not race each other to download), and the data files (present, readable,
holding `data.prompt_key`). The config's own validation already covers keys, values and an importable
reward function; the reward service refuses a function that cannot take a call at its start (exit 2).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from rlbus.config import RlbusConfig


@dataclass(frozen=True)
class Problem:
    """One thing that would make the run fail at start: the key to change and why."""

    key: str
    reason: str

    def __str__(self) -> str:
        return f"{self.key}: {self.reason}"


def model_problem(path: Path | None, key: str) -> Problem | None:
    """A model directory that is not one, or a hub id that is not in the local cache."""
    if path is None:
        return None
    text = str(path)
    local = Path(text).expanduser()
    if local.is_dir():
        if not (local / "config.json").is_file():
            return Problem(key, f"{local} has no config.json: not a Hugging Face model directory")
        return None
    if local.exists() or text.startswith(("/", ".", "~")) or text.count("/") != 1:
        return Problem(
            key,
            f"{text} does not exist: give a model directory, or a hub id (org/name) already in the local "
            "Hugging Face cache",
        )
    from huggingface_hub import constants, try_to_load_from_cache

    if isinstance(try_to_load_from_cache(text, "config.json"), str):
        return None
    return Problem(
        key,
        f"hub id {text!r} is not in the local Hugging Face cache ({constants.HF_HUB_CACHE}); rlbus does not "
        f"download at run time, where every replica would fetch it at once: `hf download {text}` "
        "first (or huggingface-cli download), or set the key to a model directory",
    )


def data_problems(cfg: RlbusConfig) -> list[Problem]:
    """Train/val files that are missing, unreadable, or without the prompt column."""
    data = cfg.data
    if data.task != "jsonl":
        return []
    problems = []
    for key, files in (("data.train_files", data.train_files), ("data.val_files", data.val_files)):
        for path in files:
            reason = _file_reason(Path(path).expanduser(), data.prompt_key)
            if reason:
                problems.append(Problem(key, reason))
    return problems


def _file_reason(path: Path, prompt_key: str) -> str:
    if not path.is_file():
        return f"{path} does not exist"
    try:
        if path.suffix == ".parquet":
            import pyarrow.parquet as pq

            columns = pq.read_schema(path).names
        else:
            first = next((line for line in path.open() if line.strip()), None)
            if first is None:
                return f"{path} is empty"
            row = json.loads(first)
            columns = list(row) if isinstance(row, dict) else []
    except Exception as exc:  # noqa: BLE001 - any unreadable file is reported with its reason
        return f"{path} cannot be read as {'parquet' if path.suffix == '.parquet' else 'JSONL'}: {exc}"
    if prompt_key not in columns:
        return (
            f"{path} has no column {prompt_key!r} (data.prompt_key); its columns: {', '.join(columns[:12])}"
        )
    return ""


def preflight(cfg: RlbusConfig) -> list[Problem]:
    """Everything that would stop the run at start, each with its key; [] when it can start."""
    models = [
        (cfg.model.path, "model.path"),
        (cfg.critic.model_path, "critic.model_path"),
        (cfg.ref.model_path, "ref.model_path"),
        (cfg.reward_model.model_path if cfg.reward_model.enable else None, "reward_model.model_path"),
    ]
    problems = [p for path, key in models if (p := model_problem(path, key)) is not None]
    return problems + data_problems(cfg)
