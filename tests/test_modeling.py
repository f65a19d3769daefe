"""rlbus.modeling: the one log-prob computation shared by learner, ref and engines."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from helpers_tiny import build_tiny_model

from rlbus.modeling import (
    load_causal_lm,
    load_tokenizer,
    pad_batch,
    pick_device,
    response_logprobs,
    token_logprobs,
)

torch.set_num_threads(2)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny_modeling"))


@pytest.fixture(scope="module")
def model(tiny: Path) -> torch.nn.Module:
    return load_causal_lm(tiny, "float32", "cpu", trainable=False)


def _manual(model: torch.nn.Module, prompt: list[int], response: list[int], temperature: float) -> np.ndarray:
    """Unpadded single-sequence forward with default positions: the ground truth."""
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float() / temperature
    logp = torch.log_softmax(logits, -1)
    n = len(prompt)
    return np.array([logp[n - 1 + i, tok].item() for i, tok in enumerate(response)], dtype=np.float32)


def test_pick_device() -> None:
    assert pick_device("cpu") == torch.device("cpu")
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert pick_device("auto").type == expected


def test_load_tokenizer_keeps_custom_pipeline(tiny: Path) -> None:
    # transformers 5 would swap in Qwen2Tokenizer for a qwen2 dir and drop spaces/newlines.
    tok = load_tokenizer(tiny)
    ids = tok.encode("12 + 3\nab", add_special_tokens=False)
    assert len(ids) == 9
    assert tok.decode(ids) == "12 + 3\nab"
    assert tok.pad_token_id is not None


def test_load_modes(tiny: Path) -> None:
    train = load_causal_lm(tiny, "float32", "cpu", trainable=True)
    assert train.training and all(p.requires_grad for p in train.parameters())
    frozen = load_causal_lm(tiny, "float32", "cpu", trainable=False)
    assert not frozen.training and not any(p.requires_grad for p in frozen.parameters())
    assert load_causal_lm(tiny, "bfloat16", "cpu").dtype == torch.bfloat16
    with pytest.raises(ValueError):
        load_causal_lm(tiny, "float8", "cpu")


def test_pad_batch_layout() -> None:
    ids, mask, pos, resp = pad_batch([[5, 6, 7], [8]], [[9, 10], [11, 12, 13]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7, 9, 10], [8, 11, 12, 13, 0]]
    assert mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]]
    assert pos.tolist() == [[0, 1, 2, 3, 4], [0, 1, 2, 3, 0]]
    # resp[b, i] == 1 where logprobs[b, i] (which predicts ids[b, i+1]) is a response token
    assert resp.tolist() == [[0, 0, 1, 1], [1, 1, 1, 0]]
    with pytest.raises(ValueError):
        pad_batch([[]], [[1]], 0)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_response_logprobs_match_unpadded_forward(model: torch.nn.Module, temperature: float) -> None:
    prompts = [[3, 4, 5, 6, 7], [8], [9, 10]]
    responses = [[11, 12], [13, 14, 15, 16, 1], []]
    got = response_logprobs(model, prompts, responses, pad_id=0, temperature=temperature, micro_batch_size=8)
    assert [len(g) for g in got] == [2, 5, 0]
    assert all(g.dtype == np.float32 for g in got)
    for p, r, g in zip(prompts, responses, got, strict=True):
        if r:
            np.testing.assert_allclose(g, _manual(model, p, r, temperature), atol=1e-5)


def test_batched_equals_one_at_a_time(model: torch.nn.Module) -> None:
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 31, (int(n),), generator=g).tolist() for n in (1, 4, 9, 2)]
    responses = [torch.randint(3, 31, (int(n),), generator=g).tolist() for n in (7, 3, 1, 12)]
    batched = response_logprobs(model, prompts, responses, 0, 1.0, micro_batch_size=4)
    split = response_logprobs(model, prompts, responses, 0, 1.0, micro_batch_size=3)
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        single = response_logprobs(model, [p], [r], 0, 1.0)[0]
        np.testing.assert_allclose(batched[i], single, atol=1e-5)
        np.testing.assert_allclose(split[i], single, atol=1e-5)


def test_temperature_zero_is_one(model: torch.nn.Module) -> None:
    a = response_logprobs(model, [[3, 4]], [[5, 6, 7]], 0, temperature=0.0)[0]
    b = response_logprobs(model, [[3, 4]], [[5, 6, 7]], 0, temperature=1.0)[0]
    np.testing.assert_array_equal(a, b)


def test_entropy_and_gradient(tiny: Path) -> None:
    model = load_causal_lm(tiny, "float32", "cpu", trainable=True)
    ids, mask, pos, resp = pad_batch([[3, 4, 5], [6]], [[7, 8], [9, 10, 11]], 0)
    lp, ent = token_logprobs(model, ids, mask, pos, temperature=0.8, return_entropy=True)
    assert lp.shape == ent.shape == (2, ids.shape[1] - 1) and lp.dtype == torch.float32
    assert bool((ent >= 0).all()) and bool((lp <= 0).all())
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids[:1]).logits[0, :-1].float() / 0.8, -1)
    torch.testing.assert_close(ent[0], -(logp.exp() * logp).sum(-1), atol=1e-5, rtol=0)
    loss = -(lp * resp).sum()
    loss.backward()
    assert model.model.embed_tokens.weight.grad is not None
