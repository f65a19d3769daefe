"""Decode attention at the embedded engine's shape: which kernel should one decode step's attention use?

On an H100 (2026-12-05) the profile of one 512 x 128 decode batch of the 0.5B shape spent 38% of its GPU time
in cuDNN's flash kernel, 46.8 us a call, where reading one layer's K and V (512 rows x 160 positions x 2 KV
heads) takes about 7 us at the card's bandwidth: flash kernels tile the query axis, which holds only the 7
folded query heads in decoding. This times one layer's masked attention (`rlbus.gqa_attention`'s folded
layout, left padding) under torch.compile with each SDPA backend, written out as two matrix products around a
softmax, and through FlexAttention (whose decoding kernel splits the KV axis), and checks each against the math
backend. On a GPU the time is the kernels' own, replayed from a CUDA graph: one call's launch from Python
costs more than its kernels at this shape (the first H100 run timed launches: 61-129 us for every variant).

    python bench/decode_attention.py                 # on the GPU: the e2e bench's decode shape
    python bench/decode_attention.py --device cpu --rows 16 --iters 5   # smoke
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def explicit(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) + mask) v, the scores in fp32: two batched matrix products."""
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(scores.softmax(-1).to(v.dtype), v)


def flex_folded(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """FlexAttention over the folded layout: the padding mask as a score modification."""
    from torch.nn.attention.flex_attention import flex_attention

    def padded(score, b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
        return torch.where(mask[b, 0, 0, kv_idx], score, -float("inf"))

    return flex_attention(q, k, v, score_mod=padded)  # type: ignore[return-value]


def flex_grouped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """FlexAttention over the query heads as transformers lays them out ([B, H, 1, D]) with ``enable_gqa``:
    its decoding kernel packs a KV head's query heads itself."""
    from torch.nn.attention.flex_attention import flex_attention

    batch, kv_heads, groups, dim = q.shape

    def padded(score, b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
        return torch.where(mask[b, 0, 0, kv_idx], score, -float("inf"))

    out = flex_attention(q.reshape(batch, kv_heads * groups, 1, dim), k, v, score_mod=padded, enable_gqa=True)
    return out.reshape(batch, kv_heads, groups, dim)  # type: ignore[union-attr]


def sdpa_with(backend: SDPBackend | None) -> Attention:
    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if backend is None:
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        with sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    return attend


def inputs(args: argparse.Namespace) -> tuple[torch.Tensor, ...]:
    """One decode step's folded queries [B, Hkv, G, D] over a static cache [B, Hkv, S, D], left padded."""
    g = torch.Generator().manual_seed(0)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    groups = args.heads // args.kv_heads

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(args.device, dtype)

    q = rand(args.rows, args.kv_heads, groups, args.head_dim)
    k = rand(args.rows, args.kv_heads, args.cache, args.head_dim)
    v = rand(args.rows, args.kv_heads, args.cache, args.head_dim)
    pad = torch.randint(0, args.cache // 2, (args.rows,), generator=g)
    filled = torch.randint(args.cache // 2, args.cache + 1, (args.rows,), generator=g)
    pos = torch.arange(args.cache)
    mask = (pos >= pad[:, None]) & (pos < filled[:, None])  # [B, S]: past the left padding, up to this step
    return q, k, v, mask[:, None, None, :].expand(args.rows, 1, groups, args.cache).to(args.device)


def time_call(fn: Attention, args: argparse.Namespace, tensors: tuple[torch.Tensor, ...]) -> float:
    """Microseconds per call, after warm-up (compile) calls: on a GPU its kernels' time, replayed from a CUDA
    graph (a call's launch costs more than its kernels here), on the CPU the wall clock."""
    for _ in range(3):
        fn(*tensors)
    if args.device == "cuda":
        from triton.testing import do_bench_cudagraph

        return float(do_bench_cudagraph(lambda: fn(*tensors), rep=200)) * 1e3
    t0 = time.perf_counter()
    for _ in range(args.iters):
        fn(*tensors)
    return (time.perf_counter() - t0) / args.iters * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--rows", type=int, default=512)
    p.add_argument("--heads", type=int, default=14)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--cache", type=int, default=160, help="static cache positions (prompt bucket + response)")
    p.add_argument("--iters", type=int, default=300)
    args = p.parse_args()
    tensors = inputs(args)
    reference = sdpa_with(SDPBackend.MATH)(*tensors).float()
    variants: dict[str, Attention] = {
        "sdpa (its own pick)": sdpa_with(None),
        "explicit": explicit,
        "flex, folded": flex_folded,
        "flex, grouped heads": flex_grouped,
    }
    if args.device == "cuda":
        variants |= {
            "sdpa cudnn": sdpa_with(SDPBackend.CUDNN_ATTENTION),
            "sdpa efficient": sdpa_with(SDPBackend.EFFICIENT_ATTENTION),
        }
    variants["sdpa math"] = sdpa_with(SDPBackend.MATH)
    print(f"{args.rows} rows x {args.heads} heads ({args.kv_heads} KV) x {args.cache} positions, d {args.head_dim}, "
          f"{args.device}, compiled", flush=True)  # fmt: skip
    for name, fn in variants.items():
        compiled = torch.compile(fn, dynamic=False)
        try:
            us = time_call(compiled, args, tensors)
            diff = (compiled(*tensors).float() - reference).abs().max().item()
        except Exception as exc:  # noqa: BLE001 - a backend this device or shape cannot take
            print(f"  {name:22s} not available: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
            continue
        print(f"  {name:22s} {us:9.1f} us a call   max |diff| vs math {diff:.2e}", flush=True)


if __name__ == "__main__":
    main()
