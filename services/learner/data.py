"""The learner's prompt source: a fixed, seeded order over the train split, resumable by position."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlbus.config.schema import DataConfig
from rlbus.tasks.registry import TASK_NAMES


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


class DataError(ValueError):
    """The data cannot train as configured; the message names the key to change."""


BUILTIN_SCORERS = (*TASK_NAMES, "math")


def check_scorers(records: list[tuple[str, dict[str, Any]]], reward_type: str) -> None:
    """With the built-in verifiers, every row's data_source must have one: never a silent reward of 0."""
    if reward_type != "task":
        return
    unknown = sorted({str(meta.get("task")) for _, meta in records} - set(BUILTIN_SCORERS))
    if unknown:
        raise DataError(
            f"no built-in verifier for data_source {unknown[:5]}: set custom_reward_function.path (and .name) to "
            "your verl compute_score file, or reward.type=function reward.function=pkg.mod:fn "
            f"(built-in: {', '.join(BUILTIN_SCORERS)})"
        )


def task_for_source(data_source: str | None) -> str:
    """The built-in verifier for a verl `data_source`: GSM8K's final number, MATH-style boxed answers, or
    our synthetic tasks; anything else is its own name (which the learner refuses unless a reward function
    is configured)."""
    if not data_source:
        return "gsm8k"
    key = str(data_source).strip().lower()
    if key in TASK_NAMES:
        return key
    if "gsm8k" in key:
        return "gsm8k"
    if "math" in key or "aime" in key or "amc" in key or "numina" in key:
        return "math"
    return str(data_source)


def record_to_item(rec: dict[str, Any], cfg: DataConfig) -> tuple[str | list[dict[str, Any]], dict[str, Any]]:
    """One row (our JSONL or verl's schema) -> (prompt text or chat messages, meta for the reward).

    verl's row: `data_source`, `prompt` (chat messages), `ability`, `reward_model: {style, ground_truth}`,
    `extra_info`. The ground truth travels both as given (`ground_truth`, for a verl compute_score) and as
    text (`answer`, for the built-in verifiers)."""
    if cfg.prompt_key not in rec:
        raise DataError(f"a data row has no '{cfg.prompt_key}' (data.prompt_key); its keys: {sorted(rec)}")
    prompt = rec[cfg.prompt_key]
    meta = {k: v for k, v in rec.items() if k != cfg.prompt_key}
    meta["task"] = str(rec.get("task") or task_for_source(rec.get("data_source")))
    reward_model = rec.get("reward_model")
    if isinstance(reward_model, dict) and "ground_truth" in reward_model:
        meta["ground_truth"] = reward_model["ground_truth"]
        meta["answer"] = str(reward_model["ground_truth"])
    elif cfg.answer_key in rec:
        meta["answer"] = _final_answer(str(rec[cfg.answer_key]), meta["task"])
        meta.setdefault("ground_truth", meta["answer"])
    if isinstance(prompt, str):
        return prompt, meta
    if isinstance(prompt, list | tuple) and all(isinstance(m, dict) and "content" in m for m in prompt):
        return [dict(m) for m in prompt], meta
    raise DataError(
        f"data.prompt_key '{cfg.prompt_key}' holds {type(prompt).__name__}: expected text or chat "
        "messages ({role, content} dicts)"
    )


def load_split(cfg: DataConfig, split: str) -> list[tuple[str | list[dict[str, Any]], dict[str, Any]]]:
    """(prompt, meta) pairs; meta carries what the reward verifier needs (task name, answer, ...)."""
    if cfg.task == "jsonl":
        files = cfg.train_files if split == "train" else cfg.val_files
        if not files:
            if split == "val":
                return []
            raise DataError("data.train_files must name JSONL/parquet files")
        return [record_to_item(rec, cfg) for rec in _read_records(files)]
    from rlbus.tasks import get_task

    task = get_task(cfg.task, digits=cfg.task_digits)
    count = cfg.num_train_examples if split == "train" else cfg.num_val_examples
    seed = cfg.seed if split == "train" else cfg.seed + 1
    return [
        (ex.prompt, {"task": cfg.task, "digits": cfg.task_digits, "answer": ex.answer, **ex.meta})
        for ex in task.make_examples(split, count, seed)
    ]


_NO_TEMPLATE_WARNED: list[bool] = []


def render_prompt(tokenizer: Any, prompt: str | list[dict[str, Any]]) -> str:
    """Chat messages through the tokenizer's chat template (with the generation prompt), as verl does.

    A tokenizer without a chat template (base models, our tiny one) gets the messages' contents joined
    by newlines, with one warning: that is the rule, not an error, so base-model recipes still run."""
    if isinstance(prompt, str):
        return prompt
    if getattr(tokenizer, "chat_template", None):
        return str(tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False))
    if not _NO_TEMPLATE_WARNED:
        _NO_TEMPLATE_WARNED.append(True)
        import logging

        logging.getLogger("rlbus.data").warning(
            "the tokenizer has no chat template: chat prompts are their messages' contents joined by newlines"
        )
    return "\n".join(str(m.get("content", "")) for m in prompt)


def truncate_prompt(ids: list[int], max_len: int, mode: str) -> list[int]:
    """verl's `data.truncation`: keep the end (left), the start (right) or both ends (middle)."""
    if len(ids) <= max_len:
        return ids
    if mode == "left":
        return ids[-max_len:]
    if mode == "right":
        return ids[:max_len]
    if mode == "middle":
        head = max_len // 2
        return ids[:head] + ids[len(ids) - (max_len - head) :]
    raise DataError(
        f"prompt of {len(ids)} tokens is over data.max_prompt_length={max_len} and "
        "data.truncation=error: raise the limit, set data.truncation=left|right|middle, or "
        "data.filter_overlong_prompts=true"
    )


def prepare_prompts(
    records: list[tuple[str | list[dict[str, Any]], dict[str, Any]]],
    tokenizer: Any,
    cfg: DataConfig,
    split: str,
) -> list[tuple[str, dict[str, Any]]]:
    """Render chat prompts, then apply verl's overlong rules at start: filter, or refuse (truncation=error)
    naming the keys, so no run dies (or silently trains on cut prompts) halfway through."""
    out: list[tuple[str, dict[str, Any]]] = []
    too_long = 0
    texts = [render_prompt(tokenizer, prompt) for prompt, _ in records]
    # one batched call (a fast tokenizer encodes the batch in parallel): a call per prompt cost a learner
    # (re)start 3 s on 20,000 prompts
    lengths = [len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]] if texts else []
    for text, (_, meta), n in zip(texts, records, lengths, strict=True):
        if n > cfg.max_prompt_length:
            too_long += 1
            if cfg.filter_overlong_prompts:
                continue
        out.append((text, meta))
    if too_long and not cfg.filter_overlong_prompts and cfg.truncation == "error":
        raise DataError(
            f"{too_long} of {len(records)} {split} prompts are over data.max_prompt_length={cfg.max_prompt_length} "
            "tokens and data.truncation=error: raise data.max_prompt_length, set data.filter_overlong_prompts=true, "
            "or data.truncation=left|right|middle"
        )
    if not out and records:
        raise DataError(f"every {split} prompt is over data.max_prompt_length={cfg.max_prompt_length}")
    return out


def prepared_split(
    cfg: DataConfig, tokenizer: Any, split: str, cache_dir: Path | None = None
) -> list[tuple[str, dict[str, Any]]]:
    """`prepare_prompts(load_split(...))`, kept in `cache_dir` (the run dir) as JSON keyed by the data config
    and the tokenizer: a restarted learner of the same run reads it back instead of building it again (the
    demo's 20,000 synthetic prompts took 1.5 s to draw and the tokenizer more to measure, every restart)."""
    import hashlib

    key = hashlib.sha256(
        json.dumps(
            [cfg.model_dump(mode="json"), split, str(getattr(tokenizer, "name_or_path", "")), len(tokenizer)],
            sort_keys=True,
        ).encode()
    ).hexdigest()[:16]
    path = cache_dir / f"prompts-{split}-{key}.json" if cache_dir is not None else None
    if path is not None and path.is_file():
        try:
            return [(str(text), dict(meta)) for text, meta in json.loads(path.read_text())]
        except (OSError, ValueError, TypeError):
            pass  # a torn write: build it again
    out = prepare_prompts(load_split(cfg, split), tokenizer, cfg, split)
    if path is not None:
        tmp = path.with_suffix(".tmp")
        try:
            text = json.dumps(out)
            if [
                (t, m) for t, m in json.loads(text)
            ] == out:  # no tuple, numpy value or int key changed on the way
                tmp.write_text(text)
                tmp.replace(path)
        except (OSError, TypeError, ValueError):
            tmp.unlink(missing_ok=True)  # not JSON-able metadata, or no room: the next start builds it again
    return out


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
        item = self.at(self.position)
        self.position += 1
        return item

    def at(self, position: int) -> PromptItem:
        """The prompt handed out at `position`, without moving on (a prompt dispatched again). It reuses the
        epoch's order: a restarted learner dispatches a batch again, and shuffling the records for each
        prompt of it cost 0.2 s on the 2-core box before the first step's work went out."""
        epoch, offset = divmod(position, len(self.records))
        prompt, meta = self.records[self._order_for(epoch)[offset]]
        return PromptItem(index=position, prompt=prompt, meta=meta)

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = int(state["position"])
