"""The embedded engine's sampler (rlbus.rollout.engines.static_decode.sample_tokens): one draw per row from
softmax(logits / T) by Gumbel-max, greedy with no noise, banned tokens never drawn, and the log-prob of the
token drawn under the engine's convention, log_softmax(logits / T) with bans left out of it."""

from __future__ import annotations

import torch

from rlbus.rollout.engines.static_decode import sample_tokens, sampler_compile_pays

LOGITS = torch.tensor([2.0, 1.0, 0.5, -1.0, 0.0])


def draw(rows: int, temperature: float, noise: float, bias: torch.Tensor | None = None):
    torch.manual_seed(0)
    logits = LOGITS.repeat(rows, 1).to(torch.bfloat16)  # the engine passes the step's logits as they come
    return sample_tokens(
        logits, torch.tensor(1.0 / temperature), torch.tensor(noise), torch.zeros(5) if bias is None else bias
    )


def test_draws_follow_the_softmax_at_the_temperature_with_their_log_probs() -> None:
    tokens, logprobs = draw(40_000, temperature=0.7, noise=1.0)
    expected = (LOGITS.to(torch.bfloat16).float() / 0.7).softmax(-1)
    seen = torch.bincount(tokens, minlength=5).float() / len(tokens)
    assert torch.allclose(seen, expected, atol=0.01), (seen, expected)
    assert torch.allclose(logprobs, expected.log()[tokens], atol=1e-5)


def test_no_noise_is_greedy_and_a_banned_token_is_never_drawn_but_keeps_its_share_of_the_log_prob() -> None:
    tokens, _ = draw(8, temperature=1.0, noise=0.0)
    assert tokens.tolist() == [0] * 8
    bias = torch.zeros(5)
    bias[0] = float("-inf")  # the end token under ignore_eos
    tokens, logprobs = draw(20_000, temperature=1.0, noise=1.0, bias=bias)
    assert 0 not in tokens.tolist()
    full = LOGITS.to(torch.bfloat16).float().log_softmax(-1)
    assert torch.allclose(logprobs, full[tokens], atol=1e-5)  # normalised over every token, banned too
    greedy, _ = draw(4, temperature=1.0, noise=0.0, bias=bias)
    assert greedy.tolist() == [1] * 4


def test_the_sampler_is_compiled_for_real_vocabularies_not_toy_ones() -> None:
    assert sampler_compile_pays(151_936) and sampler_compile_pays(32_000)  # Qwen2's, Llama 2's
    assert not sampler_compile_pays(97)  # a character tokenizer's (the demo's, the learning bench's)
