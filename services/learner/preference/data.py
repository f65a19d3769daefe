"""Preference data for a run: the configured files (or the synthetic set) read, split and tokenized."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlbus.config import RlbusConfig
from rlbus.config.schema import PreferenceConfig
from rlbus.learner.preference.dataset import (
    PreferencePair,
    UnpairedExample,
    make_synthetic_preferences,
    read_records,
    split_holdout,
    tokenize_pairs,
    tokenize_unpaired,
    unpair,
)

Seq = tuple[list[int], list[int]]  # (prompt ids, completion ids)


# --------------------------------------------------------------------------------------------------
# data


@dataclass
class PreferenceData:
    """Tokenised train and held-out sets. Paired data trains DPO/SimPO (and KTO after unpairing) and is
    evaluated pairwise; unpaired rows (KTO only) are evaluated per example."""

    train_pairs: list[PreferencePair]
    eval_pairs: list[PreferencePair]
    train_unpaired: list[UnpairedExample]
    eval_unpaired: list[UnpairedExample]


def _rows(cfg: RlbusConfig, run_dir: Path | None) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(train rows, val rows or None). Without files, a synthetic set from `data.task`, written to the run
    dir (when given: rank 0 of a torchrun group) so the exact data a run trained on can be reused."""
    pcfg = cfg.preference
    if pcfg.train_files:
        return read_records(pcfg.train_files), (read_records(pcfg.val_files) if pcfg.val_files else None)
    from rlbus.tasks import get_task

    if cfg.data.task == "jsonl":
        raise ValueError(
            "preference.train_files is empty: list JSONL/parquet preference files there "
            "(data.task=jsonl names prompt files for RL, not preference pairs)"
        )
    task = get_task(cfg.data.task, digits=cfg.data.task_digits)
    train = make_synthetic_preferences(
        task,
        pcfg.synthetic_train_examples,
        pcfg.seed,
        "train",
        run_dir and run_dir / "preferences_train.jsonl",
    )
    val = make_synthetic_preferences(
        task, pcfg.synthetic_val_examples, pcfg.seed, "val", run_dir and run_dir / "preferences_val.jsonl"
    )
    return train, val


def _is_unpaired(rows: list[dict[str, Any]], pcfg: PreferenceConfig) -> bool:
    return bool(rows) and pcfg.chosen_key not in rows[0] and pcfg.completion_key in rows[0]


def build_data(cfg: RlbusConfig, tokenizer, run_dir: Path | None) -> PreferenceData:
    """Read, tokenise, truncate and split (held-out = val_files, else `eval_fraction` of train)."""
    pcfg = cfg.preference
    train_rows, val_rows = _rows(cfg, run_dir)
    trunc: dict[str, Any] = dict(
        max_length=pcfg.max_length, max_prompt_length=pcfg.max_prompt_length, append_eos=pcfg.append_eos
    )
    pair_keys = (pcfg.prompt_key, pcfg.chosen_key, pcfg.rejected_key)
    kto_keys = (pcfg.prompt_key, pcfg.completion_key, pcfg.label_key)

    def tok(rows: list[dict[str, Any]]) -> tuple[list[PreferencePair], list[UnpairedExample]]:
        if _is_unpaired(rows, pcfg):
            if pcfg.algorithm != "kto":
                raise ValueError(
                    f"{pcfg.algorithm} needs paired rows ({', '.join(pair_keys)}); "
                    f"prompt/completion/label rows train KTO only"
                )
            return [], tokenize_unpaired(rows, tokenizer, keys=kto_keys, **trunc)
        return tokenize_pairs(rows, tokenizer, keys=pair_keys, **trunc), []

    train_pairs, train_unpaired = tok(train_rows)
    if val_rows is not None:
        eval_pairs, eval_unpaired = tok(val_rows)
    else:
        train_pairs, eval_pairs = split_holdout(train_pairs, pcfg.eval_fraction, pcfg.seed)
        train_unpaired, eval_unpaired = split_holdout(train_unpaired, pcfg.eval_fraction, pcfg.seed)
    if pcfg.algorithm == "kto" and train_pairs:
        train_unpaired = unpair(train_pairs)
    return PreferenceData(train_pairs, eval_pairs, train_unpaired, eval_unpaired)
