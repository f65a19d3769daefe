"""The learner's prompt source: a fixed, seeded order over the train split, resumable by position."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlbus.config.schema import DataConfig


@dataclass
class PromptItem:
    index: int  # position in the data order (epoch * len + offset): unique across epochs
    prompt: str
    meta: dict[str, Any]


def _read_records(paths: list[Path]) -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = []
    for path in paths:
        if path.suffix == ".parquet":
            import pyarrow.parquet as pq  # only for users who bring parquet

            records.extend(pq.read_table(path).to_pylist())
        else:
            records.extend(json.loads(line) for line in path.read_text().splitlines() if line.strip())
    return records


def _final_answer(answer: str, task: str) -> str:
    """GSM8K answers hold the worked solution then '#### 42': the verifier needs only the 42."""
    if task == "gsm8k" and "####" in answer:
        return answer.rsplit("####", 1)[1].strip().replace(",", "")
    return answer


def load_split(cfg: DataConfig, split: str) -> list[tuple[str, dict[str, Any]]]:
    """(prompt, meta) pairs; meta carries what the reward verifier needs (task name, answer, ...)."""
    if cfg.task == "jsonl":
        files = cfg.train_files if split == "train" else cfg.val_files
        if not files:
            raise ValueError(f"data.{split}_files must list JSONL/parquet files when data.task=jsonl")
        out = []
        for rec in _read_records(files):
            meta = {k: v for k, v in rec.items() if k != cfg.prompt_key}
            meta.setdefault("task", rec.get("task", "gsm8k"))
            if cfg.answer_key in rec:
                meta["answer"] = _final_answer(str(rec[cfg.answer_key]), meta["task"])
            out.append((str(rec[cfg.prompt_key]), meta))
        return out
    from rlbus.tasks import get_task

    task = get_task(cfg.task, digits=cfg.task_digits)
    count = cfg.num_train_examples if split == "train" else cfg.num_val_examples
    seed = cfg.seed if split == "train" else cfg.seed + 1
    return [
        (ex.prompt, {"task": cfg.task, "digits": cfg.task_digits, "answer": ex.answer, **ex.meta})
        for ex in task.make_examples(split, count, seed)
    ]


@dataclass
class PromptLoader:
    """Deterministic order: epoch e is the records shuffled with seed (seed, e). State = one integer."""

    records: list[tuple[str, dict[str, Any]]]
    seed: int = 0
    shuffle: bool = True
    position: int = 0  # prompts handed out so far, across epochs
    _order_epoch: int = field(default=-1, repr=False)
    _order: list[int] = field(default_factory=list, repr=False)

    def _order_for(self, epoch: int) -> list[int]:
        if epoch != self._order_epoch:
            order = list(range(len(self.records)))
            if self.shuffle:
                random.Random(f"{self.seed}:{epoch}").shuffle(order)
            self._order, self._order_epoch = order, epoch
        return self._order

    @property
    def epoch(self) -> int:
        return self.position // len(self.records)

    def next(self) -> PromptItem:
        epoch, offset = divmod(self.position, len(self.records))
        prompt, meta = self.records[self._order_for(epoch)[offset]]
        item = PromptItem(index=self.position, prompt=prompt, meta=meta)
        self.position += 1
        return item

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = int(state["position"])
