"""Throughput accounting: model FLOPs per token and MFU."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    pass


def train_flops_per_token(config: Any, seq_len: float) -> float:
    """Model FLOPs of forward + backward per token (6 N + causal attention 6 L H s), no recompute counted.

    N counts every matmul weight (the lm_head too, not the embedding lookup); attention scores and the
    weighted sum are 2 * 2 * s * H per layer forward for a causal mask (half of a full s x s), x3 with the
    backward. Matches the PaLM-style MFU accounting up to the causal halving.
    """
    h = config.hidden_size
    layers = config.num_hidden_layers
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", heads) or heads
    head_dim = getattr(config, "head_dim", None) or h // heads
    inter = config.intermediate_size
    per_layer = h * heads * head_dim + 2 * h * kv * head_dim + heads * head_dim * h + 3 * h * inter
    n_matmul = layers * per_layer + h * config.vocab_size
    attn = 6 * layers * heads * head_dim * seq_len  # causal: 2 matmuls x 2 flops x s/2 x 3 (fwd+bwd)
    return 6.0 * n_matmul + attn


def mfu(tokens_per_s: float, flops_per_token: float, peak_flops: float, world: int = 1) -> float:
    return tokens_per_s * flops_per_token / (peak_flops * world) if peak_flops > 0 else math.nan
