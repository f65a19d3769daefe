"""One policy update from a TrainBatch: advantages, clipped PG loss with TIS, optional KL and entropy terms.

The math lives in rlbus.learner.algorithms; this module only decides which pieces a config asks for and
runs them over mini-/micro-batches with gradient accumulation.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from rlbus.config import RlbusConfig
from rlbus.device_copy import to_device
from rlbus.learner import forward, microbatch
from rlbus.learner import model as model_setup
from rlbus.learner.algorithms.advantages import compute_advantages, user_advantages
from rlbus.learner.algorithms.kl import build_kl_controller, kl_estimate
from rlbus.learner.algorithms.policy_loss import (
    actor_policy_loss,
    aggregate_loss,
    truncated_is_weights,
    user_policy_loss,
)
from rlbus.learner.batch import TrainBatch, placeholder_batch, row_index
from rlbus.learner.dist import context as dist_context
from rlbus.learner.optim import build_optimizer, build_scheduler
from rlbus.modeling import round_up, torch_dtype
from rlbus.plugins import is_import_path, load_callable


class PolicyTrainer:
    def __init__(self, cfg: RlbusConfig, model_path: Path, device: torch.device, total_steps: int) -> None:
        self.cfg = cfg
        # Scale hook (dist/context.py): rank 0 of a torchrun group tells the other ranks to build theirs; the
        # model comes back with gradient checkpointing, LoRA and FSDP2 applied as configured.
        self.par = dist_context.context(device)
        self.device = self.par.device if self.par.initialized else device
        self.par.lead_init(model_path, total_steps)
        self.model = model_setup.build_policy_model(cfg, model_path, self.par)
        optim = cfg.actor.optim
        self.optimizer = build_optimizer(self.model, optim)
        self.scheduler = build_scheduler(self.optimizer, optim, total_steps)
        kl = cfg.algorithm.kl_ctrl
        self.kl_ctrl = build_kl_controller(kl.type, kl.kl_coef, kl.target_kl, kl.horizon)
        # Critic hook (PPO with GAE): a value model with its own optimizer; None for critic-free estimators.
        from rlbus.learner.critic import build_critic

        self.critic = build_critic(cfg, model_path, self.device, total_steps)
        # Estimators and policy losses named by import path (verl's registries): loaded once, here.
        algo, actor = cfg.algorithm, cfg.actor
        self.user_estimator = (
            load_callable(algo.adv_estimator, "algorithm.adv_estimator")
            if is_import_path(algo.adv_estimator)
            else None
        )
        self.user_policy_loss = (
            load_callable(actor.policy_loss, "actor.policy_loss")
            if is_import_path(actor.policy_loss)
            else None
        )

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """What the weight push sends: full tensors one at a time, state-dict order, in `model.dtype`
        (LoRA: merged, under the base model's names). Under FSDP every rank gathers alongside."""
        return self.par.lead_gather(
            lambda: model_setup.full_state_items(self.model, torch_dtype(self.cfg.model.dtype))
        )

    @property
    def compiles_layers(self) -> bool:
        """Whether the policy's decoder layers are torch.compiled (decided when the model was built)."""
        return bool(getattr(self.model, "_rlbus_compiled_layers", False))

    @property
    def compiles_kernels(self) -> bool:
        """Whether the log-prob kernels are compiled (rlbus.chunked_logprobs: on a GPU, for a large vocabulary)."""
        from rlbus.chunked_logprobs import compiles_kernels

        model: Any = self.model  # a transformers model (under FSDP2, LoRA or not)
        head = model.get_output_embeddings().weight  # the rows the kernels see (DTensor: its global shape)
        return compiles_kernels(self.device, int(head.shape[0]))

    @property
    def warms_up(self) -> bool:
        """Whether `warm_up` compiles: the layers or the log-prob kernels are compiled, and this is a learner
        of one process (with several ranks every rank would have to mirror it, so they compile on their first
        step instead)."""
        return (self.compiles_layers or self.compiles_kernels) and self.par.world_size == 1

    def warm_up(self) -> bool:
        """Compile the decoder layers and log-prob kernels now, on placeholder batches, so no real step
        compiles: rows of unequal and of equal length (each takes graphs of their own), at the smallest and
        the largest micro-batch (inductor's kernels guard on size thresholds), gradients on, and off where the
        step takes an old-log-prob pass. The gradients are dropped, weights and optimizer state untouched.
        Returns whether it compiled anything (`warms_up`)."""
        if not self.warms_up:
            return False
        actor = self.cfg.actor
        self.model.train()
        minis = 0 < actor.ppo_mini_batch_size < self.cfg.data.train_batch_size
        shapes = [(3, 40), self._largest_micro_batch()]
        for (rows, width), padded in itertools.product(shapes, (True, False)):
            batch = placeholder_batch(rows, width, self.cfg.rollout.temperature, padded=padded)
            if actor.ppo_epochs > 1 or minis or self.cfg.algorithm.use_kl_in_reward:
                self._logprobs_no_grad(batch, 2)
            logprobs, entropy = self._forward(batch, entropy=True)
            assert entropy is not None  # asked for
            ((logprobs.sum() + entropy.sum()) * 0.0).backward()
        self.optimizer.zero_grad(set_to_none=True)
        return True

    def _largest_micro_batch(self) -> tuple[int, int]:
        """(rows, tokens per row) of the largest micro-batch a step can run."""
        cfg, actor = self.cfg, self.cfg.actor
        width = round_up(cfg.data.max_prompt_length + cfg.data.max_response_length, forward.SEQ_MULTIPLE)
        rows = actor.ppo_micro_batch_size
        if cfg.model.use_remove_padding and actor.use_dynamic_bsz:
            rows = max(1, actor.ppo_max_token_len_per_gpu // width)
        return min(rows, cfg.data.train_batch_size * cfg.rollout.n), width

    def _forward(self, mb: TrainBatch, entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        return forward.forward_logprobs(
            self.model,
            mb,
            self.device,
            self.cfg.model.use_remove_padding,
            entropy,
            self.cfg.model.logprob_chunk,
            # compiled code guards on the sequence axis's alignment; eager code would only pay for padding
            forward.SEQ_MULTIPLE if self.compiles_layers or self.compiles_kernels else 1,
        )

    def _micro_batches(self, batch: TrainBatch) -> list[microbatch.MicroBatch]:
        """This rank's micro-batches (its share under data parallelism; token-bounded with use_dynamic_bsz)."""
        actor = self.cfg.actor
        return microbatch.plan_micro_batches(
            batch,
            self.par,
            actor.ppo_micro_batch_size,
            self.cfg.model.use_remove_padding,
            actor.ppo_max_token_len_per_gpu,
            token_bounded=actor.use_dynamic_bsz,  # verl's: packing and token-bounded micro-batches are two keys
        )

    @torch.no_grad()
    def _logprobs_no_grad(self, batch: TrainBatch, micro: int) -> torch.Tensor:
        out = torch.zeros(batch.response_mask.shape)
        for mbatch in self._micro_batches(batch):
            if not mbatch.dummy:
                out[mbatch.idx] = self._forward(mbatch.batch, False)[0].float().cpu()
        return self.par.all_reduce(out)  # each rank scored its share: the sum fills in the whole batch

    def _minibatches(self, batch: TrainBatch) -> list[list[int]]:
        """Mini-batches hold whole groups: `ppo_mini_batch_size` prompts (0 = everything in one)."""
        groups = batch.group_ids.tolist()
        order = sorted(set(groups))
        per = self.cfg.actor.ppo_mini_batch_size or len(order)
        out = []
        for i in range(0, len(order), per):
            chosen = set(order[i : i + per])
            out.append([j for j, g in enumerate(groups) if g in chosen])
        return out

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        batch = self.par.lead_train(batch)  # rank 0 of several: the other ranks train on it too
        actor = self.cfg.actor
        mask = batch.response_mask
        minibatches = self._minibatches(batch)
        needs_old_pass = actor.ppo_epochs * len(minibatches) > 1 or self.cfg.algorithm.use_kl_in_reward
        self.model.train()
        old_logprobs = self._logprobs_no_grad(batch, actor.ppo_micro_batch_size) if needs_old_pass else None
        advantages, returns, values, shaping_metrics = self._advantages(batch, old_logprobs)

        token_stats = _WeightedMeans()  # token-weighted means of per-token diagnostics
        loss_sums: dict[str, Any] = {}  # per mini-batch losses (device scalars until resolved), summed
        grad_norms: list[float] = []
        agg: dict[str, Any] = dict(norm_length=self.cfg.data.max_response_length)
        for _epoch in range(actor.ppo_epochs):
            for mb_idx in minibatches:
                mini = batch.select(mb_idx)
                rows = row_index(mb_idx)
                mini_adv = advantages[rows]
                mini_old = old_logprobs[rows] if old_logprobs is not None else None
                # global counts / world size: FSDP averages the ranks' gradients (see dist/__init__.py)
                agg["global_tokens"] = mini.response_mask.sum().clamp(min=1.0) / self.par.world_size
                agg["global_seqs"] = (mini.response_mask.sum(-1) > 0).float().sum().clamp(
                    min=1.0
                ) / self.par.world_size
                self.optimizer.zero_grad(set_to_none=True)
                for idx, mb in self._micro_batches(mini):
                    rows = row_index(idx)
                    old = mini_old[rows] if mini_old is not None else None
                    self._micro_step(mb, old, mini_adv[rows], agg, token_stats, loss_sums)
                grad_norm = model_setup.clip_grad_norm(self.model.parameters(), actor.optim.grad_clip)
                grad_norms.append(float(grad_norm))
                if math.isfinite(float(grad_norm)):
                    self.optimizer.step()
        loss_sums = _as_floats(loss_sums)
        token_stats.resolve()
        dist_context.reduce_stats(self.par, loss_sums, token_stats.sums, token_stats.weights)  # over ranks
        self.scheduler.step()
        n_updates = actor.ppo_epochs * len(minibatches)
        metrics = {k: v / n_updates for k, v in loss_sums.items()}
        metrics.update(token_stats.means())
        if "actor/kl" in metrics:
            self.kl_ctrl.update(metrics["actor/kl"], batch.size)
        metrics["actor/grad_norm"] = sum(grad_norms) / len(grad_norms)
        metrics["actor/lr"] = float(self.scheduler.get_last_lr()[0])
        metrics["actor/kl_coef"] = float(self.kl_ctrl.value)
        metrics["actor/advantage_abs_mean"] = float(
            (advantages.abs() * mask).sum() / mask.sum().clamp(min=1.0)
        )
        metrics.update(shaping_metrics)
        if self.critic is not None:  # critic hook: value regression on the same mini-batches
            assert values is not None  # the critic gave the old values
            metrics.update(self.critic.update(batch, returns, values, minibatches))
        self.par.end_op()
        return metrics

    def _advantages(
        self, batch: TrainBatch, old_logprobs: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, dict[str, float]]:
        """(advantages, returns, the critic's old values, reward-shaping metrics) of the whole batch."""
        algo, mask = self.cfg.algorithm, batch.response_mask
        rewards, shaping_metrics = shaped_rewards(self.cfg, batch)  # DAPO overlong punishment hook
        kl_in_reward = None
        if algo.use_kl_in_reward and batch.ref_logprobs is not None and old_logprobs is not None:
            kl_in_reward = kl_estimate(old_logprobs, batch.ref_logprobs, algo.kl_penalty) * mask
        token_rewards = None
        token_level = algo.adv_estimator in ("reinforce_plus_plus", "gae") or self.user_estimator is not None
        if token_level or kl_in_reward is not None:
            from rlbus.learner.algorithms.advantages import sequence_to_token_rewards

            token_rewards = sequence_to_token_rewards(rewards, mask, kl_in_reward, self.kl_ctrl.value)
        values = self.critic.values(batch) if self.critic is not None else None  # critic hook: old values
        if self.user_estimator is not None:
            assert token_rewards is not None
            advantages, returns = user_advantages(
                self.user_estimator, token_rewards, mask, batch.group_ids, algo
            )
        else:
            advantages, returns = compute_advantages(
                algo.adv_estimator,
                response_mask=mask,
                rewards=None if token_rewards is not None else rewards,
                group_ids=batch.group_ids,
                token_rewards=token_rewards,
                values=values,
                gamma=algo.gamma,
                lam=algo.lam,
                norm_by_std=algo.norm_adv_by_std_in_grpo,
            )
        return advantages, returns, values, shaping_metrics

    def _micro_step(
        self,
        mb: TrainBatch,
        old_logprobs: torch.Tensor | None,
        advantages: torch.Tensor,
        agg: dict[str, Any],
        token_stats: _WeightedMeans,
        loss_sums: dict[str, float],
    ) -> None:
        """Forward and backward of one micro-batch: policy loss, entropy bonus, KL loss; stats recorded."""
        actor = self.cfg.actor
        dev = self.device
        m = to_device(mb.response_mask, dev)
        logprobs, entropy = self._forward(mb, entropy=True)
        assert entropy is not None  # asked for
        old = to_device(old_logprobs, dev) if old_logprobs is not None else logprobs.detach()
        behaviour = to_device(mb.behaviour_logprobs, dev)
        is_w = truncated_is_weights(old, behaviour, m, actor.tis_cap)
        adv = to_device(advantages, dev)
        if self.user_policy_loss is not None:
            pg_loss, stats = user_policy_loss(
                self.user_policy_loss, logprobs, old, adv, m, actor.loss_agg_mode, actor, is_w
            )
        else:
            clip_low = actor.clip_ratio_low if actor.clip_ratio_low is not None else actor.clip_ratio
            clip_high = actor.clip_ratio_high if actor.clip_ratio_high is not None else actor.clip_ratio
            pg_loss, stats = actor_policy_loss(
                actor.policy_loss,
                logprobs,
                old,
                adv,
                m,
                clip_low,
                clip_high,
                actor.clip_ratio_c,
                actor.loss_agg_mode,
                is_w,
                **agg,
            )
        loss = pg_loss
        if actor.entropy_coeff:
            loss = loss - actor.entropy_coeff * aggregate_loss(entropy, m, actor.loss_agg_mode, **agg)
        if mb.ref_logprobs is not None:
            kl_tok = kl_estimate(logprobs, to_device(mb.ref_logprobs, dev), actor.kl_loss_type)
            if actor.use_kl_loss:
                loss = loss + actor.kl_loss_coef * aggregate_loss(kl_tok, m, actor.loss_agg_mode, **agg)
            token_stats.add("actor/kl", kl_tok.detach(), m)
        loss.backward()
        # statistics stay on the device until the step's end: a float() here would make the host wait for
        # this backward before it queues the next micro-batch
        _add(loss_sums, "actor/pg_loss", pg_loss.detach())
        _add(loss_sums, "actor/loss", loss.detach())
        ntok = float(mb.response_mask.sum())  # host-side copy of the mask: no wait
        for k, v in stats.items():
            token_stats.add_scalar(f"actor/{k}", torch.as_tensor(v), ntok)
        token_stats.add("actor/entropy", entropy.detach(), m)
        token_stats.add("actor/is_weight_mean", is_w, m)
        token_stats.add("actor/mismatch_kl", (old - behaviour).detach(), m)


def shaped_rewards(cfg: RlbusConfig, batch: TrainBatch) -> tuple[torch.Tensor, dict[str, float]]:
    """Sequence rewards after DAPO's soft overlong punishment (`algorithm.overlong_buffer_len` > 0)."""
    algo = cfg.algorithm
    if algo.overlong_buffer_len <= 0:
        return batch.rewards, {}
    from rlbus.learner.algorithms.dapo import overlong_penalty

    lengths = batch.response_mask.sum(-1)
    penalty = overlong_penalty(
        lengths, cfg.data.max_response_length, algo.overlong_buffer_len, algo.overlong_penalty_factor
    )
    return batch.rewards + penalty, {
        "dapo/overlong_penalty_mean": float(penalty.mean()),
        "dapo/overlong_frac": float((penalty < 0).float().mean()),
    }


def _add(sums: dict[str, Any], key: str, value: Any) -> None:
    sums[key] = sums.get(key, 0.0) + value


def _as_floats(values: dict[str, Any]) -> dict[str, float]:
    """Device scalars and floats as floats, with one transfer for all the tensors (one wait for the GPU)."""
    tensors = {k: v for k, v in values.items() if isinstance(v, torch.Tensor)}
    out = {k: float(v) for k, v in values.items() if k not in tensors}
    if tensors:
        device = next(iter(tensors.values())).device
        flat = torch.stack([t.detach().to(device, torch.float64).reshape(()) for t in tensors.values()])
        out.update(zip(tensors, flat.tolist(), strict=True))
    return out


class _WeightedMeans:
    """Token-weighted running means, so micro-batch sizes do not skew reported diagnostics. Sums and weights
    may be device scalars while a step runs; `resolve` turns them into floats once, at its end."""

    def __init__(self) -> None:
        self.sums: dict[str, Any] = {}
        self.weights: dict[str, Any] = {}

    def add(self, key: str, values: torch.Tensor, mask: torch.Tensor) -> None:
        _add(self.sums, key, (values * mask).sum())
        _add(self.weights, key, mask.sum())

    def add_scalar(self, key: str, mean: Any, weight: float) -> None:
        _add(self.sums, key, mean * weight)
        _add(self.weights, key, weight)

    def resolve(self) -> None:
        self.sums, self.weights = _as_floats(self.sums), _as_floats(self.weights)

    def means(self) -> dict[str, float]:
        self.resolve()
        return {k: self.sums[k] / self.weights[k] for k in self.sums if self.weights[k] > 0}
