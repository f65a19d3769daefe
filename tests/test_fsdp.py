"""The learner at scale on CPU: FSDP2 over 2 gloo ranks == 1 process, packing == padding, LoRA pushes merged weights.

The 2-rank runs use the real protocol: rank 0 builds PolicyTrainer (INIT), calls train_step (TRAIN) and
named_weights (GATHER), then stops the worker (STOP); rank 1 only runs `worker.worker_main`.
"""

from __future__ import annotations

import functools
import io
import multiprocessing as mp
import os
import traceback
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers_tiny import build_tiny_model

from rlbus.config import RlbusConfig, load_config
from rlbus.learner import forward, microbatch, varlen_attention
from rlbus.learner import model as model_setup
from rlbus.learner.batch import TrainBatch
from rlbus.learner.dist import context as dist_context
from rlbus.learner.dist import worker
from rlbus.modeling import pad_batch

torch.set_num_threads(1)

BASE = [
    "trainer.device=cpu",
    "actor.optim.lr=1e-2",
    "actor.ppo_mini_batch_size=2",
    "actor.ppo_micro_batch_size=2",
    "actor.use_kl_loss=true",
    "actor.kl_loss_coef=0.1",
    "actor.entropy_coeff=0.01",
    "actor.optim.grad_clip=0.5",
]
SCENARIOS: dict[str, list[str]] = {
    "padded": [],
    # one group (3 sequences) a mini-batch, 12 tokens a micro-batch: packed pairs, and ranks with fewer
    # micro-batches than the other run masked dummies
    "packed": [
        "model.use_remove_padding=true",
        "actor.use_dynamic_bsz=true",
        "actor.ppo_max_token_len_per_gpu=12",
        "actor.ppo_mini_batch_size=1",
        "actor.loss_agg_mode=seq-mean-token-mean",
    ],
    "lora": ["model.lora_rank=4", "model.lora_alpha=8", "actor.optim.lr=5e-2"],
}
COMPARED = (
    "actor/loss",
    "actor/pg_loss",
    "actor/grad_norm",
    "actor/entropy",
    "actor/kl",
    "actor/is_weight_mean",
)


def make_batch(seed: int = 0, groups: int = 4, per_group: int = 3, vocab: int = 31) -> TrainBatch:
    g = torch.Generator().manual_seed(seed)
    prompts, responses = [], []
    for _ in range(groups):
        prompt = torch.randint(3, vocab, (int(torch.randint(2, 7, (1,), generator=g)),), generator=g).tolist()
        for _ in range(per_group):
            n = int(torch.randint(1, 9, (1,), generator=g))
            prompts.append(prompt)
            responses.append(torch.randint(3, vocab, (n,), generator=g).tolist())
    ids, mask, pos, resp = pad_batch(prompts, responses, pad_id=0)
    resp = resp.float()
    bsz = ids.shape[0]
    behaviour = -torch.rand(resp.shape, generator=g) * 3 * resp
    ref = -torch.rand(resp.shape, generator=g) * 3 * resp
    rewards = torch.rand(bsz, generator=g)
    return TrainBatch(
        input_ids=ids,
        attention_mask=mask,
        position_ids=pos,
        response_mask=resp,
        behaviour_logprobs=behaviour,
        ref_logprobs=ref,
        rewards=rewards,
        correct=rewards > 0.5,
        group_ids=torch.arange(groups).repeat_interleave(per_group),
        policy_versions=torch.zeros(bsz, dtype=torch.long),
        temperature=1.0,
    )


def scenario_config(model_dir: str, name: str, device: str = "cpu") -> RlbusConfig:
    return load_config(None, [f"model.path={model_dir}", *BASE, f"trainer.device={device}", *SCENARIOS[name]])


def run_scenario(cfg: RlbusConfig, device: str = "cpu") -> dict:
    """Build a trainer, take its full state, one update, the full state again (what rank 0 reports), on the
    CPU. `device` cuda: this process's GPU (cuda:LOCAL_RANK under a distributed context)."""
    from rlbus.learner.trainer import PolicyTrainer

    where = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device(device)
    trainer = PolicyTrainer(cfg, Path(cfg.model.path), where, total_steps=4)
    before = {k: v.detach().cpu().clone() for k, v in trainer.named_weights()}
    metrics = trainer.train_step(make_batch())
    after = {k: v.detach().cpu().clone() for k, v in trainer.named_weights()}
    trainable = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    optimized = sum(len(group["params"]) for group in trainer.optimizer.param_groups)
    return {
        "before": before,
        "after": after,
        "metrics": metrics,
        "trainable": sorted(trainable),
        "optimized": optimized,
        "n_params": sum(1 for _ in trainer.model.parameters()),
    }


def _dumps(obj: object) -> bytes:
    """Tensors by value: torch's queue pickling shares file descriptors, gone once the sender exits."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _loads(data: bytes) -> object:
    return torch.load(io.BytesIO(data), weights_only=False)


def _rank_main(  # noqa: PLR0913 - a spawned process's whole brief
    rank: int, world: int, port: int, model_dir: str, names: list[str], out, device: str = "cpu"
) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
    )
    torch.set_num_threads(1)
    try:
        ctx = dist_context.init_distributed(device, timeout_s=120)
        assert ctx.distributed and ctx.world_size == world
        for name in names:
            cfg = scenario_config(model_dir, name, device)
            if rank == 0:
                result = run_scenario(cfg, device)
                ctx.stop_workers()
                out.put((name, _dumps(result)))
            else:
                assert worker.worker_main(cfg) == 0
        out.put((f"done{rank}", None))
    except BaseException:  # noqa: BLE001 - reported to the test
        out.put((f"error{rank}", traceback.format_exc()))
    finally:
        dist_context.shutdown()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny_fsdp"))


def run_two_ranks(tiny: Path, device: str = "cpu", wait_s: float = 120.0, join_s: float = 30.0) -> dict:
    """Every scenario as two spawned ranks (gloo on CPU; cuda: NCCL on cuda:0 and cuda:1); rank 0's
    results by scenario name. `wait_s` bounds the wait for each result, `join_s` each rank's exit."""
    from rlbus.weight_sync import free_port

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(r, 2, port, str(tiny), list(SCENARIOS), out, device))
        for r in range(2)
    ]
    for p in procs:
        p.start()
    results: dict = {}
    try:
        while not {"done0", "done1"} <= set(results):
            key, value = out.get(timeout=wait_s)
            if key.startswith("error"):
                raise AssertionError(f"{key}:\n{value}")
            results[key] = _loads(value) if value is not None else None
    finally:
        for p in procs:
            p.join(timeout=join_s)
            if p.is_alive():
                p.kill()
    assert all(p.exitcode == 0 for p in procs)
    return results


@pytest.fixture(scope="module")
def two_rank_results(tiny: Path) -> dict:
    return run_two_ranks(tiny)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_two_ranks_match_one_process(tiny: Path, two_rank_results: dict, name: str) -> None:
    assert_same_update(run_scenario(scenario_config(str(tiny), name)), two_rank_results[name])


def assert_same_update(one: dict, two: dict) -> None:
    """Two ranks' run of a scenario against one process's: same start, statistics and update."""
    # full_state_items of the sharded model == the unsharded model's (merged) state dict, exactly
    assert list(two["before"]) == list(one["before"])
    for k, v in one["before"].items():
        assert torch.equal(two["before"][k], v), k
    for key in COMPARED:
        assert two["metrics"][key] == pytest.approx(one["metrics"][key], rel=1e-4, abs=1e-6), key
    # Adam's first steps are ~ lr * sign(g): elements whose gradient is ~0 turn summation-order noise into
    # visible update noise, so the weights are compared relative to the size of the update itself
    update = max(float((v - one["before"][k]).abs().max()) for k, v in one["after"].items())
    assert update > 0
    total, count = 0.0, 0
    for k, v in one["after"].items():
        diff = (two["after"][k] - v).abs()
        assert float(diff.max()) <= 1e-2 * update, (k, float(diff.max()), update)
        total, count = total + float(diff.sum()), count + diff.numel()
    assert total / count <= 1e-4 * update  # (k biases have ~0 true gradient: pure noise, a few elements)
    assert two["trainable"] == one["trainable"] and two["optimized"] == one["optimized"]


def test_full_state_items_of_plain_model_is_its_state_dict(tiny: Path) -> None:
    from rlbus.modeling import load_causal_lm

    model = load_causal_lm(tiny, "float32", "cpu", trainable=True)
    items = list(model_setup.full_state_items(model))
    assert [k for k, _ in items] == list(model.state_dict())
    for (_, got), want in zip(items, model.state_dict().values(), strict=True):
        assert torch.equal(got, want)
    assert all(t.dtype == torch.bfloat16 for _, t in model_setup.full_state_items(model, torch.bfloat16))


def test_packed_logprobs_equal_padded(tiny: Path) -> None:
    from rlbus.modeling import load_causal_lm

    model = load_causal_lm(tiny, "float32", "cpu")
    batch = make_batch(seed=3)
    with torch.no_grad():
        lp_pad, ent_pad = forward.forward_logprobs(
            model, batch, torch.device("cpu"), packed=False, entropy=True
        )
        lp_pack, ent_pack = forward.forward_logprobs(
            model, batch, torch.device("cpu"), packed=True, entropy=True
        )
    m = batch.response_mask.bool()
    # padded rows compute garbage on pad positions; every real prediction must agree
    real = torch.arange(batch.input_ids.shape[1] - 1) < (batch.attention_mask.sum(-1, keepdim=True) - 1)
    assert (real | ~m).all()
    assert float((lp_pad - lp_pack).abs()[real].max()) < 1e-5
    assert float((ent_pad - ent_pack).abs()[real].max()) < 1e-5
    # a compiled learner's layout (sequence axis rounded up: more right padding, or a filler sequence)
    for packed in (False, True):
        with torch.no_grad():
            lp_8, ent_8 = forward.forward_logprobs(
                model,
                batch,
                torch.device("cpu"),
                packed=packed,
                entropy=True,
                seq_multiple=forward.SEQ_MULTIPLE,
            )
        assert lp_8.shape == lp_pad.shape and ent_8 is not None
        assert float((lp_8 - lp_pad).abs()[real].max()) < 1e-5
        assert float((ent_8 - ent_pad).abs()[real].max()) < 1e-5
    # and it really was one row: a model that saw across sequences would differ by far more
    ids = batch.input_ids[batch.attention_mask.bool()].unsqueeze(0)
    with torch.no_grad():
        leaky = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
    lengths = batch.attention_mask.sum(-1)
    b1, off = 1, int(lengths[0])
    tok = ids[0, off + 1 : off + int(lengths[b1])]
    leaky_lp = leaky[off : off + int(lengths[b1]) - 1].gather(-1, tok.unsqueeze(-1)).squeeze(-1)
    assert float((leaky_lp - lp_pack[b1, : int(lengths[b1]) - 1]).abs().max()) > 1e-3


def test_micro_batch_planning() -> None:
    lengths = [9, 1, 5, 5, 3, 7, 2, 8]
    shares = microbatch.split_for_ranks(range(8), lengths, 2)
    assert sorted(shares[0] + shares[1]) == list(range(8))
    loads = [sum(lengths[i] for i in s) for s in shares]
    assert abs(loads[0] - loads[1]) <= max(lengths)
    bins = microbatch.token_bins(list(range(8)), lengths, 10)
    assert sorted(i for b in bins for i in b) == list(range(8))
    assert all(sum(lengths[i] for i in b) <= 10 for b in bins)
    assert microbatch.token_bins([0], [12], 10) == [[0]]  # a longer sequence goes alone
    # balanced: as few bins as first-fit, the same rows, but no sliver left for the last bin
    lens = [1500, 1400, 900, 300]
    ffd = microbatch.token_bins(list(range(4)), lens, 4000)
    assert sorted(sum(lens[i] for i in b) for b in ffd) == [300, 3800]
    even = microbatch.balanced_bins(list(range(4)), lens, 4000)
    assert sorted(sum(lens[i] for i in b) for b in even) == [1800, 2300]
    assert sorted(i for b in even for i in b) == list(range(4)) and all(b == sorted(b) for b in even)
    assert microbatch.balanced_bins([0, 1], [3000, 2000], 4000) == [[0], [1]]
    # one length: runs of consecutive rows (views of the batch, the padded path's micro-batches)
    assert microbatch.balanced_bins(list(range(5)), [100] * 5, 300) == [[0, 1, 2], [3, 4]]
    more = microbatch.equalize(bins, len(bins) + 2, lengths)
    assert len(more) == len(bins) + 2 and sorted(i for b in more for i in b) == list(range(8))
    assert microbatch.equalize([[3]], 3, lengths) == [[3], [], []]  # nothing to split: dummies


def test_packing_and_token_bounded_micro_batches_are_two_keys_as_in_verl() -> None:
    """model.use_remove_padding packs each micro-batch of actor.ppo_micro_batch_size sequences into a row;
    only actor.use_dynamic_bsz bounds micro-batches by actor.ppo_max_token_len_per_gpu tokens instead."""
    batch = make_batch(groups=2, per_group=3)  # 6 sequences
    tokens = int(batch.attention_mask.sum())
    ctx = dist_context.DistContext(device=torch.device("cpu"))
    packed = microbatch.plan_micro_batches(batch, ctx, 2, packed=True, max_tokens=tokens)
    assert [mb.idx for mb in packed] == [[0, 1], [2, 3], [4, 5]]  # two sequences each, as configured
    dynamic = microbatch.plan_micro_batches(batch, ctx, 2, packed=True, max_tokens=tokens, token_bounded=True)
    assert len(dynamic) == 1 and sorted(dynamic[0].idx) == list(range(6))  # all fit one token budget


def test_config_knobs_reach_the_model(tiny: Path) -> None:
    from rlbus.learner.trainer import PolicyTrainer

    cfg = scenario_config(str(tiny), "lora")
    cfg.model.enable_gradient_checkpointing = True
    trainer = PolicyTrainer(cfg, tiny, torch.device("cpu"), total_steps=2)
    assert trainer.model.get_base_model().is_gradient_checkpointing
    trainable = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_" in n for n in trainable)
    names = [k for k, _ in trainer.named_weights()]
    assert names == _plain_state_names(tiny)  # base names, no adapters
    metrics = trainer.train_step(make_batch())
    assert np.isfinite(metrics["actor/loss"]) and metrics["actor/grad_norm"] > 0


def _plain_state_names(tiny: Path) -> list[str]:
    from rlbus.modeling import load_causal_lm

    return list(load_causal_lm(tiny, "float32", "cpu").state_dict())


# --------------------------------------------------------------------------------------- LoRA -> replica


PROBE = ([5, 6, 7, 13], [8, 9, 16, 4, 1])


def _lora_learner_process(model_dir: str, port: int, plans, done) -> None:
    """Learner stand-in: one LoRA update, then push named_weights (merged) to the engine over gloo."""
    torch.set_num_threads(1)
    try:
        import copy

        from rlbus.learner.trainer import PolicyTrainer
        from rlbus.modeling import response_logprobs
        from rlbus.weight_sync import WeightSender

        cfg = scenario_config(model_dir, "lora")
        trainer = PolicyTrainer(cfg, Path(model_dir), torch.device("cpu"), total_steps=2)
        before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        trainer.train_step(make_batch())
        changed = sorted(n for n, p in trainer.model.named_parameters() if not torch.equal(p, before[n]))
        merged = copy.deepcopy(trainer.model).merge_and_unload()
        expected = response_logprobs(merged, [PROBE[0]], [PROBE[1]], 0, 1.0)[0]
        sender = WeightSender(backend="gloo", host="127.0.0.1", timeout_s=30.0, bucket_bytes=16 << 10)
        try:
            plan = sender.plan(trainer.named_weights())
            plans.put((plan.announcement_fields(), changed, np.asarray(expected)))
            sender.open(port, world_size=2, epoch=0)
            sender.send(trainer.named_weights(), plan)
        finally:
            sender.close()
        done.put("ok")
    except BaseException:  # noqa: BLE001
        plans.put(("error", traceback.format_exc(), None))
        done.put("error")


def test_lora_update_reaches_the_replica_merged(tiny: Path) -> None:
    from rlbus.messages import WeightAnnouncement
    from rlbus.rollout.engines.hf import HFEngine
    from rlbus.weight_sync import free_port

    eng = HFEngine(tiny, device="cpu")
    before = eng.score(*PROBE)
    ctx = mp.get_context("spawn")
    plans, done = ctx.Queue(), ctx.Queue()
    port = free_port()
    proc = ctx.Process(target=_lora_learner_process, args=(str(tiny), port, plans, done))
    proc.start()
    try:
        fields, changed, expected = plans.get(timeout=90)
        assert fields != "error", changed
        # only adapter parameters moved in the learner (B of every adapted layer, then A)
        assert changed and all(".lora_" in n for n in changed)
        assert not any(".lora_" in n or "base_layer" in n for n in fields["names"])
        ann = WeightAnnouncement(
            run_id="t",
            version=1,
            epoch=0,
            master_addr="127.0.0.1",
            master_port=port,
            world_size=2,
            ranks={"r": 1},
            backend="gloo",
            **fields,
        )
        eng.receive_weights(ann, rank=1, timeout_s=30.0)
        assert done.get(timeout=30) == "ok"
        after = eng.score(*PROBE)
        np.testing.assert_allclose(after, expected, atol=1e-5)
        assert float(np.abs(after - before).max()) > 1e-3
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
        eng.close()
    assert proc.exitcode == 0


# --------------------------------------------------------------------------------------- the real service


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_torchrun_learner_service_two_ranks(nats_url: str, run_id: str, tmp_path: Path) -> None:
    """`torchrun --nproc-per-node 2 -m rlbus.learner.main`: rank 0 drives the run, rank 1 follows; the replica
    gets every version, the final export is written, and both ranks exit 0."""
    import subprocess
    import sys

    from e2e_utils import Run, make_config

    from rlbus.weight_sync import free_port

    cfg = make_config(
        nats_url,
        run_id,
        tmp_path,
        [
            "trainer.async_level=0",
            "trainer.total_training_steps=3",
            "data.train_batch_size=4",
            "rollout.n=4",
            "trainer.test_freq=-1",
            "trainer.val_before_train=false",
            "trainer.device=cpu",
            "rollout.device=cpu",
            "model.use_remove_padding=true",
            "actor.ppo_micro_batch_size=4",
            "trainer.save_freq=3",
        ],
    )
    run = Run(cfg)
    run.procs = [p for p in run.procs if p.name != "learner"]  # the learner is torchrun's
    torchrun = Path(sys.executable).with_name("torchrun")
    with run:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        log = run.run_dir / "logs" / "learner-torchrun.log"
        with open(log, "w") as out:
            proc = subprocess.run(
                [
                    str(torchrun),
                    "--nproc-per-node",
                    "2",
                    "--master-port",
                    str(free_port()),
                    "-m",
                    "rlbus.learner.main",
                    "--config",
                    str(run.config_path),
                ],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                timeout=500,
            )
        assert proc.returncode == 0, log.read_text()[-4000:]
        rows = run.metrics()
        replica = run.logs("rollout-0", 200)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(np.isfinite(r["actor/loss"]) for r in rows)
    assert "version=3" in replica and "weights updated" in replica
    assert (run.run_dir / "final" / "config.json").is_file()
    # Both ranks see one folder here: one collective checkpoint, rank 0's metadata over both shards.
    from rlbus.learner.checkpoint import latest_checkpoint, read_meta

    newest = latest_checkpoint(run.run_dir / "checkpoints")
    assert newest is not None and read_meta(newest)["layout"] == "collective"
    assert sorted(p.name for p in (newest / "state").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]


def _reference_varlen_attn(
    query,
    key,
    value,
    cu_seq_q,
    cu_seq_k,
    max_q,
    max_k,
    *,
    scale=None,
    window_size=(-1, -1),
    enable_gqa=False,
    **_,
):
    """What torch.nn.attention.varlen.varlen_attn computes (CUDA only), per sequence with sdpa, on the CPU."""
    assert window_size == (-1, 0) and cu_seq_q.dtype == torch.int32 and max_q == int(cu_seq_q.diff().max())
    outs = []
    for a, b in zip(cu_seq_q[:-1].tolist(), cu_seq_q[1:].tolist(), strict=True):
        q, k, v = (t[a:b].transpose(0, 1) for t in (query, key, value))
        outs.append(
            torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=scale, enable_gqa=enable_gqa
            ).transpose(0, 1)
        )
    return torch.cat(outs)


def test_varlen_attention_wrapper_matches_padded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The packed-row attention used on GPUs (varlen flash) agrees with padded sdpa; GQA model, CPU reference."""
    import torch.nn.attention.varlen as varlen
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rlbus.modeling import load_causal_lm

    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=31,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=128,
    )
    Qwen2ForCausalLM(cfg).save_pretrained(str(tmp_path))
    calls = []

    @functools.wraps(_reference_varlen_attn)  # keeps the signature the wrapper inspects
    def counted(*args, **kwargs):
        calls.append(1)
        return _reference_varlen_attn(*args, **kwargs)

    monkeypatch.setattr(varlen, "varlen_attn", counted)
    name = varlen_attention.packed_attention(torch.device("cuda"), torch.bfloat16)
    assert name == varlen_attention.VARLEN_ATTENTION
    packed_model = load_causal_lm(tmp_path, "float32", "cpu", attn_implementation=name)
    plain = load_causal_lm(tmp_path, "float32", "cpu")
    batch = make_batch(seed=5)
    cpu = torch.device("cpu")
    with torch.no_grad():
        want, _ = forward.forward_logprobs(plain, batch, cpu, packed=False, entropy=False)
        got, _ = forward.forward_logprobs(packed_model, batch, cpu, packed=True, entropy=False)
        # a compiled learner's packed row, rounded up by a filler sequence
        filled, _ = forward.forward_logprobs(
            packed_model, batch, cpu, packed=True, entropy=False, seq_multiple=forward.SEQ_MULTIPLE
        )
        padded, _ = forward.forward_logprobs(
            packed_model, batch, cpu, packed=False, entropy=False
        )  # sdpa fallback
    assert len(calls) == 2 * cfg.num_hidden_layers  # the packed forwards went through varlen, once a layer
    m = batch.response_mask.bool()
    assert int(batch.attention_mask.sum()) % forward.SEQ_MULTIPLE, "the filler has something to fill"
    assert float((got - want).abs()[m].max()) < 1e-5
    assert float((filled - want).abs()[m].max()) < 1e-5
    assert float((padded - want).abs()[m].max()) < 1e-5
    # in a compiled learner, rows of one length, a multiple of SEQ_MULTIPLE, have no padding to remove: they
    # run as dense rows, not through varlen; rows of another length (which would need padding) pack
    lengths = batch.attention_mask.sum(-1).tolist()
    aligned = lengths.index(forward.SEQ_MULTIPLE)
    odd = next(i for i, n in enumerate(lengths) if n % forward.SEQ_MULTIPLE)
    for row, layer_calls in ((aligned, 0), (odd, cfg.num_hidden_layers)):
        calls.clear()
        one = batch.select([row, row])
        with torch.no_grad():
            same, _ = forward.forward_logprobs(
                packed_model, one, cpu, packed=True, entropy=False, seq_multiple=forward.SEQ_MULTIPLE
            )
        assert len(calls) == layer_calls, (lengths[row], len(calls))
        assert float((same - want[[row, row]]).abs()[one.response_mask.bool()].max()) < 1e-5
