"""The folded grouped-query attention equals transformers' sdpa (which repeats K/V) under padding masks."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from rlbus.gqa_attention import GQA_SDPA, decodes_by_matmul, folded_gqa_sdpa, gqa_sdpa_attention_forward
from rlbus.messages import SamplingParams
from rlbus.modeling import load_causal_lm, response_logprobs
from rlbus.rollout.engines.base import GenerationRequest
from rlbus.rollout.engines.hf import HFEngine
from rlbus.tiny_model import build_random_qwen2


class _Attn(torch.nn.Module):
    def __init__(self, groups: int) -> None:
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = True


def _padding_mask(batch: int, q_len: int, kv_len: int, pads: list[int]) -> torch.Tensor:
    """sdpa's boolean mask [B, 1, L, S] for left-padded rows whose queries are the last L cache slots."""
    q_pos = torch.arange(kv_len - q_len, kv_len)[:, None]
    causal = torch.arange(kv_len)[None, :] <= q_pos
    keep = torch.ones(batch, kv_len, dtype=torch.bool)
    for b, pad in enumerate(pads):
        keep[b, :pad] = False
    return causal[None, None] & keep[:, None, None, :]


def _grouped_inputs(q_len: int, kv_len: int, seed: int) -> tuple[torch.Tensor, ...]:
    """Queries of 3 rows x 14 heads over 2 KV heads (head dim 16) in float64, and a left-padding mask."""
    torch.manual_seed(seed)
    batch, kv_heads, groups, dim = 3, 2, 7, 16
    q = torch.randn(batch, kv_heads * groups, q_len, dim, dtype=torch.float64)
    k = torch.randn(batch, kv_heads, kv_len, dim, dtype=torch.float64)
    v = torch.randn(batch, kv_heads, kv_len, dim, dtype=torch.float64)
    return q, k, v, _padding_mask(batch, q_len, kv_len, pads=[0, 2, kv_len - q_len])


@pytest.mark.parametrize(("q_len", "kv_len"), [(1, 40), (6, 6), (5, 23)])
def test_folded_gqa_equals_repeated_kv(q_len: int, kv_len: int) -> None:
    q, k, v, mask = _grouped_inputs(q_len, kv_len, seed=0)
    batch, heads, _, dim = q.shape
    groups = heads // k.shape[1]
    module = _Attn(groups)
    want, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=dim**-0.5)
    got, _ = gqa_sdpa_attention_forward(module, q, k, v, mask, scaling=dim**-0.5)
    assert got.shape == want.shape == (batch, q_len, heads, dim)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(("q_len", "kv_len"), [(1, 40), (5, 23)])
@pytest.mark.parametrize("additive", [False, True])
def test_matmul_attention_equals_sdpa(q_len: int, kv_len: int, additive: bool) -> None:
    """The decode step's matrix products give SDPA's attention, under a bool or an additive mask."""
    q, k, v, mask = _grouped_inputs(q_len, kv_len, seed=2)
    dim = q.shape[-1]
    if additive:
        mask = torch.zeros(mask.shape, dtype=torch.float64).masked_fill(~mask, torch.finfo(torch.float64).min)
    want = folded_gqa_sdpa(q, k, v, mask, dim**-0.5)
    got = folded_gqa_sdpa(q, k, v, mask, dim**-0.5, by_matmul=True)
    torch.testing.assert_close(got, want.float().to(got.dtype), rtol=1e-6, atol=1e-6)


def test_only_a_gpu_decode_step_goes_by_matmul() -> None:
    assert decodes_by_matmul(1, torch.device("cuda", 0))
    assert not decodes_by_matmul(7, torch.device("cuda", 0))  # prefill or scoring: SDPA's kernels
    assert not decodes_by_matmul(1, torch.device("cpu"))


def test_no_mask_is_transformers_sdpa() -> None:
    torch.manual_seed(1)
    q = torch.randn(2, 4, 5, 8)
    k, v = torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8)
    module = _Attn(2)
    want, _ = sdpa_attention_forward(module, q, k, v, None)
    got, _ = gqa_sdpa_attention_forward(module, q, k, v, None)
    assert torch.equal(got, want)


def test_engine_logprobs_equal_transformers_sdpa_recompute(tmp_path: Path) -> None:
    """A grouped-query model (4 query heads per KV head) decoded by the engine, left padded, and scored
    again by the same weights under transformers' own sdpa: the behaviour log-probs agree."""
    model_dir, _ = build_random_qwen2(tmp_path / "gqa", hidden=256, layers=2, kv_heads=1, intermediate=128)
    engine = HFEngine(model_dir, device="cpu", seed=3)
    assert engine.model.config._attn_implementation == GQA_SDPA
    reference = load_causal_lm(model_dir, "float32", "cpu", attn_implementation="sdpa")
    tok = engine.tokenizer
    prompts = [tok.encode(s, add_special_tokens=False) for s in ("12+3=", "7=", "abc de 4*5=")]
    sp = SamplingParams(temperature=0.9, max_tokens=12, ignore_eos=True)
    results = engine.generate([GenerationRequest(p, 3, sp) for p in prompts])
    for prompt, comps in zip(prompts, results, strict=True):
        ref = response_logprobs(
            reference, [prompt] * len(comps), [c.response_ids for c in comps], engine.pad_id, 0.9
        )
        for comp, want in zip(comps, ref, strict=True):
            assert len(comp.logprobs) == 12
            assert float(np.abs(comp.logprobs - want).max()) < 1e-4
