"""Held-out accuracy of a model on a task's examples, decoded here with the model's own forward (no engine):
the tiny model's build stops its SFT on it, the learning bench measures its pretraining and TRL's curve by it."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rlbus.tasks import Example, Task


@torch.no_grad()
def generate_responses(
    model,
    tokenizer,
    prompts: Sequence[str],
    temperature: float = 1.0,
    max_new_tokens: int = 8,
    seed: int = 0,
    batch_size: int = 256,
) -> list[str]:
    """Sample (temperature > 0) or greedily decode (temperature <= 0) a response per prompt.

    Prompts go in left-padded batches of `batch_size` (sorted by length, so little padding), with their
    attention mask and positions: one decode loop per batch, where batches of one length each took a loop per
    distinct length (the learning bench's evaluations: tens of loops, most of their time). Generation stops
    at eos; the response is decoded without special tokens, as rollout engines return it. Deterministic in
    `seed`.
    """
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    gen = torch.Generator(device="cpu").manual_seed(int(seed))
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    pad = eos if pad is None else pad
    encoded = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    order = sorted(range(len(prompts)), key=lambda i: len(encoded[i]))
    out: list[str] = [""] * len(prompts)
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        width = max(len(encoded[i]) for i in idx)
        ids = torch.full((len(idx), width), pad, dtype=torch.long)
        mask = torch.zeros((len(idx), width), dtype=torch.long)
        for row, i in enumerate(idx):  # left padding: every row's next token is at the same column
            ids[row, width - len(encoded[i]) :] = torch.tensor(encoded[i])
            mask[row, width - len(encoded[i]) :] = 1
        ids, mask = ids.to(device), mask.to(device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        new = torch.empty((len(idx), 0), dtype=torch.long, device=device)
        done = torch.zeros(len(idx), dtype=torch.bool, device=device)
        past = None
        for _ in range(max_new_tokens):
            res = model(
                input_ids=ids,
                attention_mask=mask,
                position_ids=positions,
                past_key_values=past,
                use_cache=True,
            )
            past = res.past_key_values
            logits = res.logits[:, -1, :].float()
            if temperature is None or temperature <= 0:
                nxt = logits.argmax(dim=-1)
            else:
                probs = torch.softmax(logits.cpu() / float(temperature), dim=-1)
                nxt = torch.multinomial(probs, 1, generator=gen).squeeze(-1).to(device)
            nxt = torch.where(done, torch.full_like(nxt, eos), nxt)
            new = torch.cat([new, nxt[:, None]], dim=1)
            done |= nxt == eos
            if bool(done.all()):
                break
            ids = nxt[:, None]
            mask = torch.cat([mask, torch.ones_like(ids)], dim=1)
            positions = positions[:, -1:] + 1
        for row, i in enumerate(idx):
            toks = new[row].tolist()
            if eos in toks:
                toks = toks[: toks.index(eos)]
            out[i] = tokenizer.decode(toks, skip_special_tokens=True)
    if was_training:
        model.train()
    return out


def evaluate_accuracy(
    model,
    tokenizer,
    task: Task,
    examples: Sequence[Example],
    temperature: float = 1.0,
    max_new_tokens: int | None = None,
    seed: int = 0,
    batch_size: int = 256,
) -> float:
    """Share of `examples` whose generated response `task.score`s as correct (0.0 for none).

    temperature <= 0 is greedy decoding; sampling is deterministic in `seed`.
    """
    if not examples:
        return 0.0
    budget = max_new_tokens if max_new_tokens is not None else task.max_new_tokens
    responses = generate_responses(
        model,
        tokenizer,
        [ex.prompt for ex in examples],
        temperature=temperature,
        max_new_tokens=budget,
        seed=seed,
        batch_size=batch_size,
    )
    correct = sum(1 for ex, resp in zip(examples, responses, strict=True) if task.score(resp, ex.meta)[1])
    return correct / len(examples)
