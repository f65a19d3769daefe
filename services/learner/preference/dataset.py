"""Preference data for offline DPO / KTO / SimPO: read rows, tokenise them, batch them.

Rows come from JSONL or parquet files with ``prompt`` / ``chosen`` / ``rejected`` (paired: DPO, SimPO,
and KTO after unpairing) or ``prompt`` / ``completion`` / ``label`` (unpaired, KTO only). Prompts and
completions may be plain strings or chat messages (``[{"role": ..., "content": ...}]``); messages are
rendered with the tokenizer's chat template. ``make_synthetic_preferences`` builds a small set from a
task (correct answer preferred over a wrong one), so tests and the example configs need no download.

Everything here is plain data work: no model, no bus. Batches go through ``rlbus.modeling.pad_batch``,
the same right-padded layout every log-prob in the project is computed on.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rlbus.modeling import pad_batch
from rlbus.tasks import Task

__all__ = [
    "PairBatch",
    "PreferencePair",
    "SequenceBatch",
    "UnpairedExample",
    "iter_batches",
    "kl_partners",
    "make_synthetic_preferences",
    "pair_batch",
    "read_records",
    "sequence_batch",
    "split_holdout",
    "tokenize_pairs",
    "tokenize_unpaired",
    "unpair",
    "write_jsonl",
]


@dataclass(frozen=True)
class PreferencePair:
    """One tokenised comparison: the same prompt with a preferred and a dispreferred completion."""

    prompt_ids: list[int]
    chosen_ids: list[int]
    rejected_ids: list[int]


@dataclass(frozen=True)
class UnpairedExample:
    """One tokenised KTO example: a completion labelled desirable (True) or undesirable (False)."""

    prompt_ids: list[int]
    completion_ids: list[int]
    desirable: bool


@dataclass
class SequenceBatch:
    """prompt+completion rows, right padded (see ``rlbus.modeling.pad_batch``)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    response_mask: torch.Tensor

    def to(self, device: torch.device) -> SequenceBatch:
        return SequenceBatch(
            *(
                t.to(device)
                for t in (self.input_ids, self.attention_mask, self.position_ids, self.response_mask)
            )
        )


@dataclass
class PairBatch:
    """``size`` pairs in one forward: rows ``[:size]`` are the chosen completions, ``[size:]`` the rejected."""

    sequences: SequenceBatch
    size: int


# --------------------------------------------------------------------------------------------------
# files


def read_records(paths: Sequence[str | Path]) -> list[dict[str, Any]]:
    """All rows of JSONL (one object a line) and parquet files, in file order.

    pyarrow is imported only for parquet, so JSONL users need nothing beyond the base install.
    """
    records: list[dict[str, Any]] = []
    for raw in paths:
        path = Path(raw).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"preference data file {path} does not exist")
        if path.suffix == ".parquet":
            try:
                import pyarrow.parquet as pq
            except ImportError as exc:  # pragma: no cover - depends on the environment
                raise ImportError(
                    f"reading {path} needs pyarrow (pip install pyarrow), or convert to JSONL"
                ) from exc
            records.extend(pq.read_table(path).to_pylist())
            continue
        for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: not a JSON object ({exc.msg})") from None
    return records


def write_jsonl(rows: Sequence[dict[str, Any]], path: str | Path) -> Path:
    """Rows as JSONL (the format `read_records` reads back), parent folders created."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


# --------------------------------------------------------------------------------------------------
# synthetic data


def wrong_answer(answer: str, rng: random.Random) -> str:
    """``answer`` with one digit moved up or down by one (never to a leading zero): the near miss a model
    that half knows the sum (or drops a carry) makes, so the pair differs in exactly the token that decides
    correctness and the preference stays informative for a model that is already often right."""
    positions = [i for i, ch in enumerate(answer) if ch.isdigit()]
    if not positions:
        return answer + "0"
    i = rng.choice(positions)
    digit = int(answer[i])
    leading = i == 0 and len(answer) > 1
    options = [d for d in ((digit + 1) % 10, (digit - 1) % 10) if not (leading and d == 0)]
    return answer[:i] + str(rng.choice(options)) + answer[i + 1 :]


def make_synthetic_preferences(
    task: Task, n: int, seed: int = 0, split: str = "train", path: str | Path | None = None
) -> list[dict[str, str]]:
    """``n`` rows ``{"prompt", "chosen", "rejected"}`` from ``task``: chosen is the reference answer,
    rejected the same answer with one digit wrong (e.g. "37+45=" -> "82" over "83").

    Deterministic in (task, n, seed, split); the task's train and val splits share no prompt, so a val
    set made here is truly held out. Written as JSONL to ``path`` when given.
    """
    rng = random.Random(f"rlbus:preferences:{task.name}:{split}:{int(seed)}")
    rows = [
        {"prompt": ex.prompt, "chosen": ex.answer, "rejected": wrong_answer(ex.answer, rng)}
        for ex in task.make_examples(split, n, seed)
    ]
    if path is not None:
        write_jsonl(rows, path)
    return rows


# --------------------------------------------------------------------------------------------------
# tokenisation


def _is_messages(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(m, dict) and "content" in m for m in value)


def _prompt_ids(tokenizer, prompt: Any) -> list[int]:
    """Chat messages through the chat template (which adds whatever special tokens the model expects);
    a plain string with the tokenizer's own special tokens (e.g. Llama's BOS; none for Qwen or the tiny
    model), as the model would see it at inference."""
    if _is_messages(prompt):
        text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return list(tokenizer(str(prompt), add_special_tokens=True)["input_ids"])


def _completion_ids(tokenizer, completion: Any, append_eos: bool) -> list[int]:
    """Completion tokens (messages: their contents joined), ending with eos so the model learns to stop."""
    text = "".join(str(m["content"]) for m in completion) if _is_messages(completion) else str(completion)
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    eos = tokenizer.eos_token_id
    if append_eos and eos is not None and (not ids or ids[-1] != eos):
        ids.append(int(eos))
    return ids


def _split_implicit_prompt(chosen: Any, rejected: Any) -> tuple[Any, Any, Any]:
    """Rows without a prompt column whose chosen/rejected are full conversations: the prompt is every
    message but the last (the shared context), the completions are the last messages."""
    if not (_is_messages(chosen) and _is_messages(rejected)) or len(chosen) < 2 or len(rejected) < 2:
        raise ValueError(
            "a row without a prompt needs chosen/rejected conversations of at least two messages"
        )
    return chosen[:-1], chosen[-1:], rejected[-1:]


def truncate(
    prompt: list[int], completion: list[int], max_length: int, max_prompt_length: int | None = None
) -> tuple[list[int], list[int]]:
    """Fit prompt+completion into ``max_length``: the prompt keeps its end (the part next to the answer,
    at most ``max_length - 1`` tokens so one completion token fits), the completion keeps its start."""
    keep = min(max_prompt_length or max_length, max_length - 1)
    prompt = prompt[-keep:]
    return prompt, completion[: max_length - len(prompt)]


def tokenize_pairs(
    records: Sequence[dict[str, Any]],
    tokenizer,
    max_length: int,
    max_prompt_length: int | None = None,
    append_eos: bool = True,
    keys: tuple[str, str, str] = ("prompt", "chosen", "rejected"),
) -> list[PreferencePair]:
    """Rows -> token pairs, truncated to ``max_length``; rows with an empty prompt are dropped (a first
    completion token needs a context to be predicted from)."""
    prompt_key, chosen_key, rejected_key = keys
    pairs = []
    for i, row in enumerate(records):
        missing = [k for k in (chosen_key, rejected_key) if k not in row]
        if missing:
            raise ValueError(f"preference row {i} lacks {missing} (has {sorted(row)})")
        prompt, chosen, rejected = row.get(prompt_key), row[chosen_key], row[rejected_key]
        if prompt is None:
            prompt, chosen, rejected = _split_implicit_prompt(chosen, rejected)
        p = _prompt_ids(tokenizer, prompt)
        if not p:
            continue
        pc, c = truncate(p, _completion_ids(tokenizer, chosen, append_eos), max_length, max_prompt_length)
        _, r = truncate(p, _completion_ids(tokenizer, rejected, append_eos), max_length, max_prompt_length)
        pairs.append(PreferencePair(pc, c, r))
    if not pairs:
        raise ValueError("no usable preference pairs (every row was empty or had an empty prompt)")
    return pairs


def _as_bool(value: Any, row: int) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int | float) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in ("true", "false", "1", "0"):
        return value.strip().lower() in ("true", "1")
    raise ValueError(f"KTO row {row}: label must be a boolean, got {value!r}")


def tokenize_unpaired(
    records: Sequence[dict[str, Any]],
    tokenizer,
    max_length: int,
    max_prompt_length: int | None = None,
    append_eos: bool = True,
    keys: tuple[str, str, str] = ("prompt", "completion", "label"),
) -> list[UnpairedExample]:
    """KTO rows ``prompt`` / ``completion`` / ``label`` (bool: desirable) -> token examples."""
    prompt_key, completion_key, label_key = keys
    out = []
    for i, row in enumerate(records):
        missing = [k for k in keys if k not in row]
        if missing:
            raise ValueError(f"KTO row {i} lacks {missing} (has {sorted(row)})")
        p = _prompt_ids(tokenizer, row[prompt_key])
        if not p:
            continue
        comp = _completion_ids(tokenizer, row[completion_key], append_eos)
        p, comp = truncate(p, comp, max_length, max_prompt_length)
        out.append(UnpairedExample(p, comp, _as_bool(row[label_key], i)))
    if not out:
        raise ValueError("no usable KTO examples")
    return out


def unpair(pairs: Sequence[PreferencePair]) -> list[UnpairedExample]:
    """Each pair as two KTO examples, chosen desirable and rejected undesirable (TRL's
    ``unpair_preference_dataset``), so paired data sets train KTO too."""
    out = []
    for p in pairs:
        out.append(UnpairedExample(p.prompt_ids, p.chosen_ids, True))
        out.append(UnpairedExample(p.prompt_ids, p.rejected_ids, False))
    return out


def kl_partners(examples: Sequence[UnpairedExample], seed: int = 0) -> list[tuple[list[int], list[int]]]:
    """For example i, its prompt with an unrelated example's completion: KTO estimates KL(pi || ref) on
    such mismatched pairs. Fixed once (a seeded derangement) so their reference log-probs can be
    computed up front like every other reference log-prob."""
    n = len(examples)
    order = list(range(n))
    random.Random(f"rlbus:kto-kl:{int(seed)}").shuffle(order)
    partner = {order[k]: order[(k + 1) % n] for k in range(n)}
    return [(list(ex.prompt_ids), list(examples[partner[i]].completion_ids)) for i, ex in enumerate(examples)]


# --------------------------------------------------------------------------------------------------
# splits and batches


def split_holdout(items: Sequence[Any], fraction: float, seed: int = 0) -> tuple[list[Any], list[Any]]:
    """(train, held_out): a seeded ``fraction`` of ``items`` (at least one when fraction > 0 and there
    are two or more items) is held out for evaluation."""
    items = list(items)
    if fraction <= 0 or len(items) < 2:
        return items, []
    order = list(range(len(items)))
    random.Random(f"rlbus:holdout:{int(seed)}").shuffle(order)
    n_eval = min(len(items) - 1, max(1, round(fraction * len(items))))
    held = set(order[:n_eval])
    return [x for i, x in enumerate(items) if i not in held], [x for i, x in enumerate(items) if i in held]


def iter_batches(
    n: int, batch_size: int, shuffle: bool = True, seed: int = 0, epoch: int = 0
) -> Iterator[list[int]]:
    """Index batches over ``n`` items, reshuffled per epoch (seeded), the last one possibly smaller."""
    order = list(range(n))
    if shuffle:
        random.Random(f"rlbus:pref-order:{int(seed)}:{int(epoch)}").shuffle(order)
    for start in range(0, n, batch_size):
        yield order[start : start + batch_size]


def sequence_batch(
    prompts: Sequence[list[int]], completions: Sequence[list[int]], pad_id: int
) -> SequenceBatch:
    """The project's one batch layout (``pad_batch``), wrapped for moving to a device."""
    return SequenceBatch(*pad_batch(list(prompts), list(completions), pad_id))


def pair_batch(pairs: Sequence[PreferencePair], pad_id: int) -> PairBatch:
    """Chosen and rejected of every pair in ONE forward (TRL's concatenated forward): half the kernel
    launches, and both sides see the same padding width."""
    prompts = [p.prompt_ids for p in pairs]
    completions = [p.chosen_ids for p in pairs] + [p.rejected_ids for p in pairs]
    return PairBatch(sequence_batch(prompts + prompts, completions, pad_id), len(pairs))
