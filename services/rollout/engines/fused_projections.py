"""One matrix product for a decoder layer's q, k and v projections, and one for its MLP's gate and up.

At decode, a step of 512 rows spends most of its GPU time in small kernels: on an H100 at the 0.5B shape the
k and v projections took 4.2 us each and q 5.3 us, in every layer of every token (torch profiler, 2026-12-05).
vLLM merges them into one GEMM each (QKVParallelLinear, MergedColumnParallelLinear); so does this, without
changing the model's names:

- the fused weight is one tensor; q_proj/k_proj/v_proj (gate_proj/up_proj) keep their parameters as views of
  it, so state_dict, named_parameters and a weight push that copies in place see what they always saw;
- q_proj computes all three and hands k and v to k_proj and v_proj, which the attention calls next with the
  same input (gate/up alike). A call that does not follow that order computes its own product.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn
from torch.nn import functional as F  # noqa: N812


class _Handoff:
    """The last input q_proj (gate_proj) saw and the products it computed for the projections called next,
    as one tuple: a forward on another thread meanwhile (a compile of the decode step beside the batches, say)
    replaces it whole, so a follower reads its own input's products or none, never another's."""

    def __init__(self) -> None:
        self.last: tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None = None


class _Member(nn.Linear):
    """A projection of a fused group."""

    handoff: _Handoff
    position: int


class _Lead(_Member):
    """The first projection: computes the fused product, returns its own part, keeps the others."""

    fused_weight: torch.Tensor
    fused_bias: torch.Tensor | None
    split_sizes: list[int]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.fused_weight, self.fused_bias)
        mine, *rest = out.split(self.split_sizes, dim=-1)
        self.handoff.last = (x, tuple(rest))
        return mine


class _Follower(_Member):
    """A later projection: takes its part from the lead's product (for the same input), else computes it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        handoff = self.handoff
        last = handoff.last
        if last is None or last[0] is not x:
            return F.linear(x, self.weight, self.bias)
        products = last[1]
        if self.position == len(products) and handoff.last is last:  # the group's last: free the products
            handoff.last = None
        return products[self.position - 1]


def _fuse(linears: list[nn.Linear]) -> None:
    """Makes `linears` (same input, stacked outputs) share one weight (and bias), the first one leading."""
    weight = torch.cat([m.weight.detach() for m in linears])
    biases = [m.bias.detach() for m in linears if m.bias is not None]
    bias = torch.cat(biases) if biases else None
    handoff = _Handoff()
    start = 0
    for i, module in enumerate(linears):
        end = start + module.out_features
        module.weight = nn.Parameter(weight[start:end], requires_grad=False)
        if bias is not None:
            module.bias = nn.Parameter(bias[start:end], requires_grad=False)
        module.__class__ = _Lead if i == 0 else _Follower
        cast(_Member, module).handoff = handoff
        cast(_Member, module).position = i
        start = end
    lead = cast(_Lead, linears[0])
    lead.split_sizes = [m.out_features for m in linears]
    lead.register_buffer("fused_weight", weight, persistent=False)
    lead.register_buffer("fused_bias", bias, persistent=False)


def fuse_projections(model: nn.Module) -> int:
    """Fuses q/k/v and gate/up in every decoder layer that has them as plain Linears of one input size,
    dtype and device, all with a bias or none (Qwen2, Llama and their kin); returns how many groups were
    fused. For inference, after the model is on its device: the parameters stop requiring grad."""
    fused = 0
    for module in list(model.modules()):
        for names in (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")):
            linears = [getattr(module, n, None) for n in names]
            if not all(type(m) is nn.Linear for m in linears):
                continue
            group = [m for m in linears if isinstance(m, nn.Linear)]
            same_input = len({m.in_features for m in group}) == 1
            same_kind = len({(m.bias is None, m.weight.dtype, m.weight.device) for m in group}) == 1
            if same_input and same_kind:
                _fuse(group)
                fused += 1
    return fused
