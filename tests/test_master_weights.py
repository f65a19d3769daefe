"""actor.master_weights=optimizer: bf16 parameters, fp32 master weights and moments in the optimizer."""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from rlbus.config import load_config
from rlbus.learner.optim import MasterWeightAdamW
from rlbus.learner.trainer import PolicyTrainer
from rlbus.tiny_model import default_model_path

HYPER = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}


def _grads(steps: int, shape: tuple[int, ...]) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=g).to(torch.bfloat16).float() for _ in range(steps)]  # bf16-exact


def test_update_equals_fp32_adamw_and_params_are_the_rounded_master() -> None:
    init = torch.randn(64, 32, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    low = torch.nn.Parameter(init.clone())
    ref = torch.nn.Parameter(init.float().clone())
    ours, theirs = MasterWeightAdamW([low], **HYPER), torch.optim.AdamW([ref], **HYPER)
    for g in _grads(5, tuple(init.shape)):
        low.grad, ref.grad = g.to(torch.bfloat16), g.clone()
        ours.step()
        theirs.step()
    master = ours.state[low]["master"]
    assert master.dtype == torch.float32
    torch.testing.assert_close(master, ref.detach(), rtol=0, atol=1e-6)
    assert torch.equal(low.detach(), master.to(torch.bfloat16))


def test_updates_below_bf16_resolution_accumulate() -> None:
    """lr 1e-6 on weights near 1: each step is far below one bf16 step (2^-7); plain bf16 AdamW never moves."""
    low = torch.nn.Parameter(torch.ones(16, dtype=torch.bfloat16))
    plain = torch.nn.Parameter(torch.ones(16, dtype=torch.bfloat16))
    ours = MasterWeightAdamW([low], lr=1e-6, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    bf16_adamw = torch.optim.AdamW([plain], lr=1e-6, weight_decay=0.0)
    for _ in range(20):
        low.grad = torch.ones_like(low)
        plain.grad = torch.ones_like(plain)
        ours.step()
        bf16_adamw.step()
    assert torch.equal(plain.detach(), torch.ones_like(plain))  # the update was lost
    moved = 1.0 - ours.state[low]["master"]
    torch.testing.assert_close(
        moved, torch.full_like(moved, 20e-6), rtol=0.05, atol=0
    )  # fp32 ulp at 1 is 1.2e-7


def test_checkpoint_state_keeps_fp32_master() -> None:
    def make() -> tuple[torch.nn.Module, MasterWeightAdamW]:
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 4).to(torch.bfloat16)
        return model, MasterWeightAdamW(model.parameters(), **HYPER)

    model, opt = make()
    for g in _grads(3, (4, 8)):
        model.weight.grad, model.bias.grad = g.to(torch.bfloat16), g[:, 0].to(torch.bfloat16)
        opt.step()
    model_sd, optim_sd = get_state_dict(model, opt)
    fresh_model, fresh_opt = make()
    set_state_dict(fresh_model, fresh_opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    for a, b in zip(model.parameters(), fresh_model.parameters(), strict=True):
        sa, sb = opt.state[a], fresh_opt.state[b]
        assert sb["master"].dtype == torch.float32 and sb["exp_avg_sq"].dtype == torch.float32
        assert torch.equal(sa["master"], sb["master"]) and torch.equal(sa["exp_avg"], sb["exp_avg"])
        assert float(sa["step"]) == float(sb["step"]) == 3.0


def test_policy_trainer_trains_bf16_parameters_with_fp32_master() -> None:
    cfg = load_config(
        None,
        [
            "trainer.device=cpu",
            "model.dtype=bfloat16",
            "actor.master_weights=optimizer",
            "actor.ppo_micro_batch_size=4",
        ],
    )
    trainer = PolicyTrainer(cfg, default_model_path(), torch.device("cpu"), total_steps=10)
    assert isinstance(trainer.optimizer, MasterWeightAdamW)
    assert all(p.dtype == torch.bfloat16 for p in trainer.model.parameters())
    from tests.test_chunked_logprobs import _batch  # a small GRPO batch over the tiny model's vocabulary

    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    vocab = trainer.model.config.vocab_size
    batch = _batch(8, 16)
    batch.input_ids %= vocab
    metrics = trainer.train_step(batch)
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values())
    changed = [n for n, p in trainer.model.named_parameters() if not torch.equal(p.detach(), before[n])]
    assert changed
    p = next(trainer.model.parameters())
    assert torch.equal(p.detach(), trainer.optimizer.state[p]["master"].to(torch.bfloat16))
