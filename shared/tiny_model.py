"""The tiny warm-started model that the embedded default trains: built here, nothing downloaded.

`build_tokenizer` makes a character-level tokenizer (one token per character) with the `tokenizers`
library, saved as a `PreTrainedTokenizerFast` that transformers' AutoTokenizer and vLLM load.
`build_tiny_model` makes a small Qwen2 (hidden 128, 4 heads of head_dim 32, 2 KV heads, 2 layers;
vLLM's CPU attention needs head_dim 32 or 64) and warm-starts it with a short, deterministic SFT on
a task, stopping as soon as its sampled (T=1) val accuracy reaches a target, so that RL still has
room to improve it. The committed build lives in `assets/tiny-addition/` inside the package.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rlbus.held_out import evaluate_accuracy
from rlbus.tasks import Example, get_task

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)
# Digits and arithmetic first (the tasks' alphabet), then what countdown prompts and a little text use.
CHARACTERS = "0123456789+-*=() " + ":,.?#/\n" + "abcdefghijklmnopqrstuvwxyz"
MAX_POSITIONS = 128
INFO_FILE = "rlbus_tiny.json"
DEFAULT_MODEL_NAME = "tiny-addition"
FORMAT_VERSION = 1

# Defaults of the committed build (the embedded default model).
DEFAULT_SFT_STEPS = 2000
DEFAULT_TARGET_SAMPLED_ACCURACY = 0.25


# --------------------------------------------------------------------------------------------------
# tokenizer


def _tokenizer_object():
    from tokenizers import Tokenizer, decoders, models

    vocab = {tok: i for i, tok in enumerate([*SPECIAL_TOKENS, *CHARACTERS])}
    # BPE with no merges and no pre-tokenizer = exactly one token per character; spaces and
    # newlines are ordinary characters. Fuse joins decoded tokens without separators.
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return tok


def make_tokenizer():
    """The character-level tokenizer as a transformers `PreTrainedTokenizerFast` (not saved)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=_tokenizer_object(),
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        model_max_length=MAX_POSITIONS,
        clean_up_tokenization_spaces=False,
    )


def build_tokenizer(out_dir: str | os.PathLike):
    """Build the character-level tokenizer and save it into `out_dir`; returns the tokenizer."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tokenizer()
    save_tokenizer(tokenizer, out)
    return tokenizer


def save_tokenizer(tokenizer, out_dir: str | os.PathLike) -> None:
    """Save `tokenizer`; its class is recorded as PreTrainedTokenizerFast, which transformers 4.x
    and 5.x (where it is an alias of TokenizersBackend) and vLLM all resolve."""
    tokenizer.save_pretrained(str(out_dir))
    cfg_path = Path(out_dir) / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n", encoding="utf-8")


# --------------------------------------------------------------------------------------------------
# model


def make_config(tokenizer, **overrides):
    """The tiny Qwen2 configuration for `tokenizer` (head_dim 32: vLLM's CPU attention accepts it)."""
    from transformers import Qwen2Config

    kwargs = dict(
        vocab_size=len(tokenizer),
        hidden_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_hidden_layers=2,
        intermediate_size=256,
        hidden_act="silu",
        max_position_embeddings=MAX_POSITIONS,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        use_sliding_window=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )
    kwargs.update(overrides)
    return Qwen2Config(**kwargs)


def build_random_qwen2(
    out_dir: Path,
    hidden: int,
    layers: int,
    kv_heads: int,
    intermediate: int,
    max_positions: int = MAX_POSITIONS,
) -> tuple[Path, int]:
    """A random-weight Qwen2 of a given shape (head_dim 64) on the tiny character tokenizer, saved to
    `out_dir`, seed 0: benchmarks compare engines on a model where compute, not bookkeeping, dominates,
    without downloading one. Returns the folder and the parameter count."""
    from transformers import Qwen2ForCausalLM

    tok = build_tokenizer(out_dir)
    config = make_config(
        tok,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=kv_heads,
        head_dim=64,
        intermediate_size=intermediate,
        max_position_embeddings=max_positions,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(str(out_dir))
    return out_dir, sum(p.numel() for p in model.parameters())


@contextlib.contextmanager
def _torch_threads(n: int | None) -> Iterator[None]:
    if not n:
        yield
        return
    old = torch.get_num_threads()
    torch.set_num_threads(int(n))
    try:
        yield
    finally:
        torch.set_num_threads(old)


def encode_example(tokenizer, example: Example) -> tuple[list[int], list[int]]:
    """(input ids, labels) of prompt + answer + eos; labels are -100 on the prompt."""
    prompt = tokenizer(example.prompt, add_special_tokens=False)["input_ids"]
    answer = tokenizer(example.answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return prompt + answer, [-100] * len(prompt) + answer


def collate_sft(tokenizer, examples: Sequence[Example]) -> dict[str, torch.Tensor]:
    """A right-padded SFT batch of `examples` (`encode_example`: loss on the answer and its end token)."""
    rows = [encode_example(tokenizer, ex) for ex in examples]
    width = max(len(ids) for ids, _ in rows)
    pad = tokenizer.pad_token_id
    input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (ids, lab) in enumerate(rows):  # right padding: positions stay 0..n-1
        input_ids[i, : len(ids)] = torch.tensor(ids)
        labels[i, : len(lab)] = torch.tensor(lab)
        mask[i, : len(ids)] = 1
    return {"input_ids": input_ids, "attention_mask": mask, "labels": labels}


def _fresh_model(tokenizer: Any, seed: int) -> Any:
    """A randomly initialised tiny Qwen2 (seeded), generating with the tokenizer's special tokens."""
    from transformers import GenerationConfig, Qwen2ForCausalLM

    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(make_config(tokenizer)).float()
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return model


@dataclass
class SftResult:
    steps_done: int = 0
    reached: bool = False
    loss: float = float("nan")
    history: list[dict] = field(default_factory=list)


def sft_step(
    model: torch.nn.Module,
    batch: dict[str, torch.Tensor],
    optim: torch.optim.Optimizer,
    sched: torch.optim.lr_scheduler.LRScheduler,
    autocast: contextlib.AbstractContextManager = contextlib.nullcontext(),
) -> torch.Tensor:
    """One update on a `collate_sft` batch (loss on the answer tokens), gradients clipped to norm 1;
    returns the loss, detached. `autocast` wraps the forward (bf16 on a GPU)."""
    with autocast:
        loss = model(**batch).loss
    optim.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optim.step()
    sched.step()
    return loss.detach()


def _warm_start(
    model: torch.nn.Module,
    tokenizer: Any,
    task: Any,
    stop_set: list,
    *,
    seed: int,
    sft_steps: int,
    target: float | None,
    batch_size: int,
    lr: float,
    warmup_steps: int,
    eval_every: int,
    say: Callable[[str], None],
) -> SftResult:
    """SFT: prompt + answer + eos, loss on the answer tokens (and eos) only, AdamW with a linear warm-up,
    one fresh batch of train examples per step. Every `eval_every` steps the sampled (T=1) accuracy on
    `stop_set` is measured; SFT stops at the first that reaches `target` (None: all `sft_steps`)."""
    optim = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(
        optim, lambda s: min(1.0, (s + 1) / max(1, warmup_steps)) if warmup_steps else 1.0
    )
    result = SftResult()
    model.train()
    for step in range(1, sft_steps + 1):
        batch = collate_sft(tokenizer, task.make_examples("train", batch_size, seed=seed * 1_000_003 + step))
        loss = sft_step(model, batch, optim, sched)
        result.steps_done = step
        result.loss = float(loss)
        if target is not None and (step % eval_every == 0 or step == sft_steps):
            acc = evaluate_accuracy(model, tokenizer, task, stop_set, temperature=1.0, seed=seed + step)
            result.history.append({"step": step, "loss": round(result.loss, 5), "val_sampled_accuracy": acc})
            say(f"step {step} loss {result.loss:.4f} val sampled accuracy {acc:.3f}")
            if acc >= target:
                result.reached = True
                break
    return result


def build_tiny_model(
    out_dir: str | os.PathLike,
    task: str = "addition",
    digits: int = 2,
    seed: int = 0,
    sft_steps: int = DEFAULT_SFT_STEPS,
    target_sampled_accuracy: float | None = DEFAULT_TARGET_SAMPLED_ACCURACY,
    batch_size: int = 64,
    lr: float = 1e-3,
    warmup_steps: int = 20,
    eval_every: int = 10,
    eval_examples: int = 256,
    final_eval_examples: int = 1000,
    num_threads: int | None = 1,
    log: Callable[[str], None] | None = None,
) -> dict:
    """Build the tokenizer and a tiny Qwen2, warm-start it by SFT on `task` (`_warm_start`), save all
    into `out_dir`. Seeded and run on `num_threads` CPU threads (1 makes it bit-for-bit reproducible).
    Writes the model, tokenizer and `rlbus_tiny.json` (build parameters and measured accuracies, which
    is also returned, with `build_seconds` added)."""
    t0 = time.monotonic()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    the_task = get_task(task, digits=digits)
    say = log or (lambda msg: None)

    with _torch_threads(num_threads):
        tokenizer = make_tokenizer()
        model = _fresh_model(tokenizer, seed)
        sft = _warm_start(
            model,
            tokenizer,
            the_task,
            the_task.make_examples("val", eval_examples, seed=seed),
            seed=seed,
            sft_steps=sft_steps,
            target=target_sampled_accuracy,
            batch_size=batch_size,
            lr=lr,
            warmup_steps=warmup_steps,
            eval_every=eval_every,
            say=say,
        )
        model.eval()
        final_set = the_task.make_examples("val", final_eval_examples, seed=seed + 1)
        sampled = evaluate_accuracy(model, tokenizer, the_task, final_set, temperature=1.0, seed=seed + 7)
        greedy = evaluate_accuracy(model, tokenizer, the_task, final_set, temperature=0.0, seed=seed)

    model.save_pretrained(str(out))
    save_tokenizer(tokenizer, out)
    info = {
        "format": FORMAT_VERSION,
        "task": the_task.name,
        "digits": digits,
        "seed": seed,
        "sft_steps": sft_steps,
        "sft_steps_done": sft.steps_done,
        "target_sampled_accuracy": target_sampled_accuracy,
        "target_reached": sft.reached,
        "batch_size": batch_size,
        "lr": lr,
        "warmup_steps": warmup_steps,
        "eval_every": eval_every,
        "eval_examples": eval_examples,
        "final_eval_examples": len(final_set),
        "final_train_loss": round(sft.loss, 5),
        "val_accuracy_sampled_t1": sampled,
        "val_accuracy_greedy": greedy,
        "max_new_tokens": the_task.max_new_tokens,
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "history": sft.history,
        "versions": _versions(),
    }
    (out / INFO_FILE).write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
    return {**info, "build_seconds": round(time.monotonic() - t0, 2)}


def _versions() -> dict[str, str]:
    import transformers

    from rlbus import __version__

    return {"rlbus": __version__, "torch": torch.__version__, "transformers": transformers.__version__}


def read_info(model_dir: str | os.PathLike) -> dict:
    """The `rlbus_tiny.json` of a tiny-model directory ({} if absent)."""
    path = Path(model_dir) / INFO_FILE
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


# --------------------------------------------------------------------------------------------------
# the default model


def default_model_path() -> Path:
    """The committed tiny model shipped inside the package: `rlbus/assets/tiny-addition/`."""
    return Path(__file__).resolve().parent / "assets" / DEFAULT_MODEL_NAME


def cache_dir() -> Path:
    """rlbus's user cache: $RLBUS_CACHE_DIR, else $XDG_CACHE_HOME/rlbus, else ~/.cache/rlbus."""
    if os.environ.get("RLBUS_CACHE_DIR"):
        return Path(os.environ["RLBUS_CACHE_DIR"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "rlbus"


def is_model_dir(path: str | os.PathLike) -> bool:
    p = Path(path)
    return (
        (p / "config.json").is_file()
        and (p / "model.safetensors").is_file()
        and (p / "tokenizer.json").is_file()
    )


def ensure_default_model(log: Callable[[str], None] | None = None) -> Path:
    """A directory holding the default tiny model: the committed asset, else a build in the cache.

    The cache build (`<cache>/tiny-addition`) is made in a temporary sibling and renamed into
    place, so a concurrent or interrupted build never leaves a half-written model behind.
    """
    asset = default_model_path()
    if is_model_dir(asset):
        return asset
    target = cache_dir() / DEFAULT_MODEL_NAME
    if is_model_dir(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL_NAME}-", dir=target.parent))
    try:
        build_tiny_model(tmp, log=log)
        try:
            os.replace(tmp, target)
        except OSError:
            if not is_model_dir(target):  # someone else won the race only if theirs is complete
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target
