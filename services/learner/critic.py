"""The PPO critic: a value model trained in the learner next to the policy.

A causal-LM backbone (the decoder stack of `critic.model_path`, or of the policy's initial checkpoint when
that is None) with a scalar value head, `nn.Linear(hidden, 1)` on the last hidden states, as
`AutoModelForTokenClassification(num_labels=1)` builds it. The head starts at zero, so the first advantages
are plain whitened returns and the critic never injects noise before it has learnt anything.

Alignment: `values(batch)` is [B, L-1] like `token_logprobs`: entry t is the value of the state that
predicts token t+1 (the hidden state at position t), i.e. the value of the prefix *before* each response
token. `gae_advantages` then uses V_t for the state before response token t and 0 after the last one.

The math (`clipped_value_loss`) lives in rlbus.learner.algorithms; this module only runs it over the same
mini-/micro-batches as the policy update, with its own AdamW.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from rlbus.config import RlbusConfig
from rlbus.learner.algorithms.advantages import masked_mean
from rlbus.learner.algorithms.value_loss import clipped_value_loss
from rlbus.learner.batch import TrainBatch
from rlbus.learner.optim import build_optimizer, build_scheduler
from rlbus.modeling import torch_dtype


def load_backbone(path: str | Path, dtype: str, trust_remote_code: bool = False) -> nn.Module:
    """The decoder stack of a causal-LM checkpoint (no LM head): AutoModel strips the `model.` prefix."""
    from transformers import AutoModel

    return AutoModel.from_pretrained(
        str(path), dtype=torch_dtype(dtype), attn_implementation="sdpa", trust_remote_code=trust_remote_code
    )


class ValueModel(nn.Module):
    """Backbone + zero-initialised scalar head (float32, whatever the backbone's dtype)."""

    def __init__(self, backbone: nn.Module) -> None:
        super().__init__()
        self.backbone = backbone
        hidden = int(cast(Any, backbone).config.hidden_size)
        self.value_head = nn.Linear(hidden, 1, dtype=torch.float32)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor
    ) -> torch.Tensor:
        """[B, L-1] values: entry t is V(prefix up to and including token t), aligned with token_logprobs."""
        out = self.backbone(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        )
        hidden = out.last_hidden_state[:, :-1]
        return self.value_head(hidden.float()).squeeze(-1)


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """1 - Var[R - V] / Var[R] over valid tokens: 1 is a perfect critic, 0 a constant one, < 0 worse."""
    mask = mask.to(torch.float32)
    values, returns = values.float(), returns.float()
    var_r = masked_mean((returns - masked_mean(returns, mask)) ** 2, mask)
    resid = returns - values
    var_e = masked_mean((resid - masked_mean(resid, mask)) ** 2, mask)
    if float(var_r) <= 1e-12:
        return 0.0
    return float(1.0 - var_e / var_r)


class Critic:
    def __init__(self, cfg: RlbusConfig, model_path: Path, device: torch.device, total_steps: int) -> None:
        self.cfg = cfg
        self.device = device
        path = cfg.critic.model_path or model_path
        self.model = ValueModel(load_backbone(path, cfg.model.dtype, cfg.model.trust_remote_code)).to(device)
        self.model.train()
        if cfg.model.enable_gradient_checkpointing and hasattr(
            self.model.backbone, "gradient_checkpointing_enable"
        ):
            cast(Any, self.model.backbone).gradient_checkpointing_enable()
        # the policy's builders: critic.optim.eps now counts too (it was left at torch's default)
        self.optimizer = build_optimizer(self.model, cfg.critic.optim)
        self.scheduler = build_scheduler(self.optimizer, cfg.critic.optim, total_steps)

    def _forward(self, mb: TrainBatch) -> torch.Tensor:
        return self.model(
            mb.input_ids.to(self.device), mb.attention_mask.to(self.device), mb.position_ids.to(self.device)
        )

    @torch.no_grad()
    def values(self, batch: TrainBatch, micro: int | None = None) -> torch.Tensor:
        """[B, L-1] float32 values on the CPU, 0 off the response (what GAE and the value clip use)."""
        micro = micro or self.cfg.actor.ppo_micro_batch_size
        chunks = [
            self._forward(batch.select(range(i, min(i + micro, batch.size)))).float().cpu()
            for i in range(0, batch.size, micro)
        ]
        return torch.cat(chunks) * batch.response_mask

    def update(
        self,
        batch: TrainBatch,
        returns: torch.Tensor,
        old_values: torch.Tensor,
        minibatches: list[list[int]] | None = None,
    ) -> dict[str, float]:
        """Clipped value regression towards `returns` over `minibatches` (default: one), `actor.ppo_epochs` times.

        Loss per optimizer step: `value_loss_coef * clipped_value_loss` with the mini-batch's token count as
        the denominator, so micro-batch accumulation gives the mini-batch's loss exactly.
        """
        ccfg, actor = self.cfg.critic, self.cfg.actor
        mask = batch.response_mask
        minibatches = minibatches or [list(range(batch.size))]
        micro = actor.ppo_micro_batch_size
        agg: dict[str, Any] = {}  # value regression is per token: token-mean over the mini-batch
        self.model.train()
        vf_loss_sum, clip_sum, tokens, grad_norms, n_updates = 0.0, 0.0, 0.0, [], 0
        for _epoch in range(actor.ppo_epochs):
            for mb_idx in minibatches:
                mini = batch.select(mb_idx)
                mini_ret, mini_old = returns[mb_idx], old_values[mb_idx]
                agg["global_tokens"] = mini.response_mask.sum().clamp(min=1.0)
                self.optimizer.zero_grad(set_to_none=True)
                mini_loss = 0.0
                for start in range(0, mini.size, micro):
                    idx = list(range(start, min(start + micro, mini.size)))
                    mb = mini.select(idx)
                    m = mb.response_mask.to(self.device)
                    vpred = self._forward(mb)
                    vf_loss, clipfrac = clipped_value_loss(
                        vpred,
                        mini_old[idx].to(self.device),
                        mini_ret[idx].to(self.device),
                        m,
                        ccfg.cliprange_value,
                        "token-mean",
                        **agg,
                    )
                    (ccfg.value_loss_coef * vf_loss).backward()
                    mini_loss += float(vf_loss.detach())
                    ntok = float(m.sum())
                    clip_sum += float(clipfrac) * ntok
                    tokens += ntok
                grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), ccfg.optim.grad_clip)
                grad_norms.append(float(grad_norm))
                if torch.isfinite(grad_norm):
                    self.optimizer.step()
                vf_loss_sum += mini_loss
                n_updates += 1
        self.scheduler.step()
        return {
            "critic/vf_loss": vf_loss_sum / max(1, n_updates),
            "critic/vf_clipfrac": clip_sum / max(1.0, tokens),
            "critic/grad_norm": sum(grad_norms) / max(1, len(grad_norms)),
            "critic/lr": float(self.scheduler.get_last_lr()[0]),
            "critic/values_mean": float(masked_mean(old_values, mask)),
            "critic/returns_mean": float(masked_mean(returns, mask)),
            "critic/explained_variance": explained_variance(old_values, returns, mask),
        }

    def state_dict(self) -> dict[str, object]:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])


def build_critic(cfg: RlbusConfig, model_path: Path, device: torch.device, total_steps: int) -> Critic | None:
    """A critic when the advantage estimator needs one (`gae`), else None."""
    if cfg.algorithm.adv_estimator != "gae":
        return None
    return Critic(cfg, model_path, device, total_steps)
