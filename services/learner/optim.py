"""Optimizers and learning-rate schedules of the learner (policy and critic): AdamW, or AdamW with the fp32
master weights kept in the optimizer; verl's warmup then constant or cosine decay.

``actor.master_weights=optimizer`` holds the model in ``model.dtype`` (bf16): forward, backward and the
gradients are bf16 end to end, as in a hand-written bf16 loop, with no per-op casts and a bf16 residual
stream. The update still happens in fp32 on a master copy kept in the optimizer state, then is copied back:
an RL learning rate of 1e-6 moves a weight of 0.02 by 1/20 of one bf16 step, so plain bf16 AdamW would
drop most updates. The cost is memory (4 extra bytes per parameter for the master) and gradients
accumulated over micro-batches in bf16. The master lives in the optimizer state, so checkpoints keep it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch.optim.adamw import adamw


class MasterWeightAdamW(torch.optim.Optimizer):
    """AdamW over low-precision parameters; per parameter the state holds ``master`` (fp32), ``exp_avg``,
    ``exp_avg_sq`` (fp32) and ``step``. After each step the parameters are the master rounded to their dtype."""

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter],
        lr: float,
        betas: tuple[float, float],
        eps: float,
        weight_decay: float,
    ) -> None:
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001 - torch's signature
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            params, masters, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], [], []
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                    state["master"] = p.detach().float().clone()
                    state["exp_avg"] = torch.zeros_like(state["master"])
                    state["exp_avg_sq"] = torch.zeros_like(state["master"])
                params.append(p)
                masters.append(state["master"])
                grads.append(p.grad.float())
                exp_avgs.append(state["exp_avg"])
                exp_avg_sqs.append(state["exp_avg_sq"])
                steps.append(state["step"])
            if not params:
                continue
            beta1, beta2 = group["betas"]
            fused = masters[0].is_cuda
            adamw(
                masters,
                grads,
                exp_avgs,
                exp_avg_sqs,
                [],
                steps,
                foreach=None if fused else True,
                fused=fused or None,
                amsgrad=False,
                beta1=beta1,
                beta2=beta2,
                lr=group["lr"],
                weight_decay=group["weight_decay"],
                eps=group["eps"],
                maximize=False,
            )
            torch._foreach_copy_(params, masters)
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's loader casts every floating state tensor to its parameter's dtype, which would round the
        master weights and moments to bf16: they are put back in fp32 afterwards."""
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        fp32 = {
            i: {
                k: v.detach().to(torch.float32, copy=True)
                for k, v in state_dict["state"][i].items()
                if k != "step" and torch.is_tensor(v)
            }
            for i in saved_ids
            if i in state_dict["state"]
        }
        super().load_state_dict(state_dict)
        for i, p in zip(saved_ids, params, strict=True):
            for k, v in fp32.get(i, {}).items():
                self.state[p][k] = v.to(p.device)


def build_optimizer(model: torch.nn.Module, optim) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters; fused on CUDA. A model that `model.build_policy_model` left
    in bf16/fp16 for ``actor.master_weights`` (optimizer, or auto on one rank) gets `MasterWeightAdamW`."""
    params = [p for p in model.parameters() if p.requires_grad]
    kwargs = {
        "lr": optim.lr,
        "betas": tuple(optim.betas),
        "eps": optim.eps,
        "weight_decay": optim.weight_decay,
    }
    if getattr(model, "_rlbus_master_in_optimizer", False):
        return MasterWeightAdamW(params, **kwargs)
    fused = bool(params) and params[0].is_cuda
    return torch.optim.AdamW(params, fused=fused or None, **kwargs)


def warmup_steps(optim, total_steps: int) -> int:
    """verl's rule: lr_warmup_steps, or (when it is -1) lr_warmup_steps_ratio of the total steps."""
    if optim.lr_warmup_steps >= 0:
        return int(optim.lr_warmup_steps)
    return int(optim.lr_warmup_steps_ratio * total_steps)


def lr_lambda(step: int, warmup: int, total: int, schedule: str, min_ratio: float) -> float:
    """Linear warmup, then constant or cosine decay to `min_ratio` of the base lr."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    if schedule == "constant" or total <= warmup:
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(
    optimizer: torch.optim.Optimizer, optim, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """`optim`'s schedule (warmup, then `lr_scheduler` down to `min_lr_ratio`) over `total_steps`."""
    warmup = warmup_steps(optim, total_steps)
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_lambda(s, warmup, total_steps, optim.lr_scheduler, optim.min_lr_ratio)
    )
