"""Chunked log-probs: the same numbers and gradients as full logits, without ever holding them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import Qwen2Config, Qwen2ForCausalLM

from rlbus.chunked_logprobs import chunked_logprobs, supports_chunked_head
from rlbus.config import load_config
from rlbus.learner.batch import TrainBatch
from rlbus.learner.trainer import PolicyTrainer
from rlbus.modeling import positions_from_mask, token_logprobs

VOCAB = 4096


def _model_dir(tmp_path: Path) -> Path:
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
    )
    Qwen2ForCausalLM(config).save_pretrained(str(tmp_path / "model"))
    return tmp_path / "model"


def _batch(rows: int, width: int, prompt: int = 4) -> TrainBatch:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (rows, width), generator=g)
    mask = torch.ones(rows, width, dtype=torch.long)
    mask[0, width // 2 :] = 0  # one short row: padding stays exact
    resp = torch.zeros(rows, width - 1)
    resp[:, prompt - 1 :] = 1.0
    resp[0, width // 2 - 1 :] = 0.0
    return TrainBatch(
        input_ids=ids,
        attention_mask=mask,
        position_ids=positions_from_mask(mask),
        response_mask=resp,
        behaviour_logprobs=-torch.rand(rows, width - 1, generator=g) * resp,
        ref_logprobs=None,
        rewards=torch.rand(rows, generator=g),
        correct=torch.zeros(rows, dtype=torch.bool),
        group_ids=torch.arange(rows) // 4,
        policy_versions=torch.zeros(rows, dtype=torch.long),
        temperature=1.0,
    )


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_values_and_gradients_match_full_logits(tmp_path: Path, temperature: float) -> None:
    model = Qwen2ForCausalLM.from_pretrained(str(_model_dir(tmp_path)), dtype=torch.float64).train()
    assert supports_chunked_head(model)
    b = _batch(4, 24)
    grads = []
    for chunk in (0, 7):  # 0: the full-logits path; 7 does not divide the token count
        model.zero_grad()
        lp, ent = token_logprobs(
            model,
            b.input_ids,
            b.attention_mask,
            b.position_ids,
            temperature,
            return_entropy=True,
            chunk_tokens=chunk,
        )
        m = b.response_mask
        ((lp * m).sum() * 0.3 + (ent * m).sum() * 0.1 + (lp.exp() * m).sum()).backward()
        grads.append((lp.detach(), ent.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (lp0, ent0, g0), (lp1, ent1, g1) = grads
    # logits are fp32 in both paths (the convention), so agreement is to fp32 rounding
    torch.testing.assert_close(lp1, lp0, rtol=0, atol=2e-5)
    torch.testing.assert_close(ent1, ent0, rtol=0, atol=2e-5)
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=1e-4, atol=1e-6, msg=name)


def test_positions_skip_the_head_elsewhere_and_change_nothing_the_loss_sees(tmp_path: Path) -> None:
    """Only the masked positions go through the output projection: their values and the gradient of a loss
    over them equal the full computation; the other positions read 0."""
    model = Qwen2ForCausalLM.from_pretrained(str(_model_dir(tmp_path)), dtype=torch.float64).train()
    b = _batch(4, 24)
    m = b.response_mask.bool()
    head = model.get_output_embeddings()
    seen: list[int] = []
    results = []
    for positions in (None, m):
        model.zero_grad()
        seen.clear()
        with _RowsThroughHead(seen):
            lp, ent = token_logprobs(
                model,
                b.input_ids,
                b.attention_mask,
                b.position_ids,
                return_entropy=True,
                chunk_tokens=16,
                positions=positions,
            )
        ((lp * m).sum() + 0.1 * (ent * m).sum()).backward()
        results.append((lp.detach(), ent.detach(), head.weight.grad.clone(), sum(seen)))
    (lp0, ent0, g0, rows0), (lp1, ent1, g1, rows1) = results
    torch.testing.assert_close(lp1[m], lp0[m], rtol=0, atol=2e-5)
    torch.testing.assert_close(ent1[m], ent0[m], rtol=0, atol=2e-5)
    assert not lp1[~m].any() and not ent1[~m].any()
    torch.testing.assert_close(g1, g0, rtol=1e-4, atol=1e-6)  # fp32 logits, sums in another order
    assert rows0 == m.numel() and rows1 == int(m.sum()) < rows0


class _RowsThroughHead(TorchDispatchMode):
    """Counts the rows of every product with the [vocab, hidden] output weight (forward only)."""

    def __init__(self, seen: list[int]) -> None:
        super().__init__()
        self.seen = seen

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.mm.default and out.dim() == 2 and out.shape[1] == VOCAB:
            self.seen.append(int(out.shape[0]))
        return out


def test_custom_function_matches_autograd_in_bf16_autocast() -> None:
    """Under autocast the products run in bf16, as nn.Linear's would; the fp32 softmax math agrees."""
    torch.manual_seed(0)
    h = torch.randn(40, 16, requires_grad=True)
    w = torch.randn(300, 16, requires_grad=True)
    t = torch.randint(0, 300, (40,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lp, ent = chunked_logprobs(h, w, t, 1.0, chunk=16)
        z = torch.nn.functional.linear(h, w).float().log_softmax(-1)
    want_lp = z.gather(-1, t[:, None]).squeeze(-1)
    want_ent = -(z.exp() * z).sum(-1)
    torch.testing.assert_close(lp, want_lp, rtol=0, atol=1e-4)
    torch.testing.assert_close(ent, want_ent, rtol=0, atol=1e-4)


class _LargestAllocation(TorchDispatchMode):
    """The largest tensor any op produces while active, in bytes (CPU has no allocator statistics)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel() * t.element_size())
        return out


def _largest_in_train_step(model_dir: Path, chunk_overrides: list[str]) -> int:
    cfg = load_config(
        None,
        [
            f"model.path={model_dir}",
            "trainer.device=cpu",
            "actor.ppo_micro_batch_size=8",
            "actor.entropy_coeff=0.01",
            *chunk_overrides,
        ],
    )
    trainer = PolicyTrainer(cfg, model_dir, torch.device("cpu"), total_steps=10)
    with _LargestAllocation() as probe:
        metrics = trainer.train_step(_batch(8, 128))
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values())
    return probe.largest


def test_learner_never_allocates_full_vocabulary_logits(tmp_path: Path) -> None:
    """8 x 127 predicted tokens x 4096 vocab: full fp32 logits are 16.6 MB; a 64-token chunk's are 1 MB."""
    model_dir = _model_dir(tmp_path)
    chunk = 64
    bound = 2 * chunk * VOCAB * 4  # a chunk's fp32 logits, twice: the logits and their softmax
    full_logits = 8 * 127 * VOCAB * 4
    chunked = _largest_in_train_step(model_dir, [f"model.logprob_chunk_tokens={chunk}"])
    plain = _largest_in_train_step(model_dir, ["model.use_fused_kernels=false"])
    assert chunked <= bound < full_logits <= plain, (chunked, bound, plain)


def test_the_chunk_kernels_compile_only_on_a_gpu_for_a_large_vocabulary() -> None:
    from rlbus.chunked_logprobs import COMPILE_MIN_VOCAB, compiles_kernels

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert compiles_kernels(cuda, 151_936) and compiles_kernels(cuda, COMPILE_MIN_VOCAB)
    assert not compiles_kernels(cuda, 64)  # the demo model's characters: eager costs less than a compile
    assert not compiles_kernels(cpu, 151_936)
