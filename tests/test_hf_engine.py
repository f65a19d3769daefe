"""HFEngine: generation, behaviour log-probs == the shared recompute, stops, seeds, weight swaps."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers_tiny import build_tiny_model

from rlbus.gqa_attention import GQA_SDPA
from rlbus.messages import SamplingParams
from rlbus.modeling import response_logprobs
from rlbus.rollout.engines.base import GenerationRequest
from rlbus.rollout.engines.hf import HFEngine

torch.set_num_threads(2)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny_hf"))


@pytest.fixture(scope="module", params=["generate", "static-decode"])
def engine(tiny: Path, request: pytest.FixtureRequest) -> HFEngine:
    """The CPU default (transformers' generate) and the GPU's path (our own loop on planned static caches,
    here uncompiled): every behaviour below holds for both."""
    if request.param == "generate":
        return HFEngine(tiny, dtype="float32", device="cpu", seed=0)
    from rlbus.rollout.engines.decode_shapes import plan_decode_shapes

    shapes = plan_decode_shapes(256, 64, 64)
    return HFEngine(tiny, dtype="float32", device="cpu", seed=0, static_decode=True, decode_shapes=shapes)


def _prompts(engine: HFEngine) -> list[list[int]]:
    tok = engine.tokenizer
    return [tok.encode(s, add_special_tokens=False) for s in ("12+3=", "7=", "abc de 4*5=")]


def _max_diff(engine: HFEngine, prompts: list[list[int]], results, temperature: float) -> float:
    worst = 0.0
    for prompt, comps in zip(prompts, results, strict=True):
        recomputed = response_logprobs(
            engine.model, [prompt] * len(comps), [c.response_ids for c in comps], engine.pad_id, temperature
        )
        for comp, ref in zip(comps, recomputed, strict=True):
            assert comp.logprobs.dtype == np.float32
            assert len(comp.logprobs) == len(comp.response_ids) == len(ref)
            if len(ref):
                worst = max(worst, float(np.abs(comp.logprobs - ref).max()))
    return worst


def test_shapes_n_and_max_tokens(engine: HFEngine) -> None:
    prompts = _prompts(engine)
    sp = SamplingParams(temperature=1.0, max_tokens=8)
    reqs = [GenerationRequest(p, n, sp) for p, n in zip(prompts, (4, 1, 3), strict=True)]
    res = engine.generate(reqs)
    assert [len(r) for r in res] == [4, 1, 3]
    for comps in res:
        for c in comps:
            assert 1 <= len(c.response_ids) <= 8
            assert c.finish_reason in ("stop", "length")
            assert (c.finish_reason == "length") == (len(c.response_ids) == 8 and c.response_ids[-1] != 1)
    assert engine.generate([]) == []


@pytest.mark.parametrize(
    "sp",
    [
        SamplingParams(temperature=1.0, max_tokens=24),
        SamplingParams(temperature=0.7, max_tokens=24),
        SamplingParams(temperature=0.7, top_k=5, max_tokens=24),
        SamplingParams(temperature=1.3, top_p=0.8, max_tokens=24),
        SamplingParams(temperature=0.0, max_tokens=24),
    ],
    ids=["t1", "t0.7", "t0.7-topk5", "t1.3-topp0.8", "greedy"],
)
def test_behaviour_logprobs_equal_recompute(engine: HFEngine, sp: SamplingParams) -> None:
    assert engine.model.config._attn_implementation == GQA_SDPA  # (tests/test_gqa_attention: grouped heads)
    prompts = _prompts(engine)
    res = engine.generate([GenerationRequest(p, 4, sp) for p in prompts])
    assert _max_diff(engine, prompts, res, sp.temperature) < 1e-4


def test_top_k_filters_sampling_not_logprobs(engine: HFEngine) -> None:
    prompts = _prompts(engine)
    greedy = engine.generate(
        [GenerationRequest(p, 1, SamplingParams(temperature=0.0, max_tokens=12)) for p in prompts]
    )
    top1 = engine.generate(
        [GenerationRequest(p, 2, SamplingParams(temperature=0.5, top_k=1, max_tokens=12)) for p in prompts]
    )
    for g, t in zip(greedy, top1, strict=True):
        for c in t:
            assert c.response_ids == g[0].response_ids
            # recorded at T=0.5 over the full vocabulary, so not 0 although top-1 made it certain
            assert float(c.logprobs.max()) < 0
    assert _max_diff(engine, prompts, top1, 0.5) < 1e-4


def test_greedy_is_argmax(engine: HFEngine) -> None:
    prompt = _prompts(engine)[0]
    res = engine.generate([GenerationRequest(prompt, 3, SamplingParams(temperature=0.0, max_tokens=10))])[0]
    assert all(c.response_ids == res[0].response_ids for c in res)
    ids = list(prompt)
    expected, expected_lp = [], []
    with torch.no_grad():
        for _ in range(len(res[0].response_ids)):
            logp = torch.log_softmax(engine.model(input_ids=torch.tensor([ids])).logits[0, -1].float(), -1)
            tok = int(logp.argmax())
            expected.append(tok)
            expected_lp.append(float(logp[tok]))
            ids.append(tok)
            if tok in engine.eos_ids:
                break
    assert res[0].response_ids == expected
    np.testing.assert_allclose(res[0].logprobs, expected_lp, atol=1e-5)


def test_seed_determinism(engine: HFEngine) -> None:
    prompts = _prompts(engine)
    seeded = SamplingParams(temperature=1.0, max_tokens=16, seed=1234)
    a = engine.generate([GenerationRequest(prompts[0], 4, seeded)])[0]
    other = SamplingParams(temperature=1.0, max_tokens=16)
    # the same seeded request, now batched next to others: still the same samples
    b = engine.generate([GenerationRequest(prompts[1], 2, other), GenerationRequest(prompts[0], 4, seeded)])[
        1
    ]
    assert [c.response_ids for c in a] == [c.response_ids for c in b]
    np.testing.assert_array_equal(
        np.concatenate([c.logprobs for c in a]), np.concatenate([c.logprobs for c in b])
    )
    c = engine.generate([GenerationRequest(prompts[0], 4, seeded.model_copy(update={"seed": 99}))])[0]
    assert [x.response_ids for x in a] != [x.response_ids for x in c]
    # unseeded calls advance the engine's own stream, and leave the global torch RNG alone
    state = torch.random.get_rng_state()
    u1 = engine.generate([GenerationRequest(prompts[0], 4, other)])[0]
    u2 = engine.generate([GenerationRequest(prompts[0], 4, other)])[0]
    assert [x.response_ids for x in u1] != [x.response_ids for x in u2]
    assert torch.equal(state, torch.random.get_rng_state())
    # two engines with the same seed make the same unseeded stream
    twin = HFEngine(engine.model_path, device="cpu", seed=5)
    twin2 = HFEngine(engine.model_path, device="cpu", seed=5)
    t1 = twin.generate([GenerationRequest(prompts[2], 3, other)])[0]
    t2 = twin2.generate([GenerationRequest(prompts[2], 3, other)])[0]
    assert [x.response_ids for x in t1] == [x.response_ids for x in t2]


def test_stop_strings(engine: HFEngine) -> None:
    prompts = _prompts(engine)
    stops = ["1", "2", " a", "ab"]
    sp = SamplingParams(temperature=1.0, max_tokens=24, stop=stops, seed=3)
    res = engine.generate([GenerationRequest(p, 8, sp) for p in prompts])
    tok = engine.tokenizer
    n_stopped = 0
    for comps in res:
        for c in comps:
            full = tok.decode(c.response_ids)
            before = tok.decode(c.response_ids[:-1])
            assert not any(s in before for s in stops)  # never runs past a stop
            if c.extra.get("stop_by") == "stop_string":
                n_stopped += 1
                assert c.finish_reason == "stop"
                assert any(full.endswith(s) for s in stops)
            elif c.finish_reason == "length":
                assert len(c.response_ids) == 24 and not any(s in full for s in stops)
    assert n_stopped >= 6
    assert _max_diff(engine, prompts, res, 1.0) < 1e-4


def test_eos_is_kept_and_finishes(tiny: Path) -> None:
    eng = HFEngine(tiny, device="cpu", seed=1)
    state = {k: v.clone() for k, v in eng.model.state_dict().items()}
    state["model.norm.weight"].zero_()  # logits all 0: uniform over the vocabulary, EOS comes often
    eng.load_weights(state, version=3)
    assert eng.policy_version == 3
    vocab = eng.model.config.vocab_size
    res = eng.generate([GenerationRequest([5, 6], 24, SamplingParams(temperature=1.0, max_tokens=40))])[0]
    eos = eng.tokenizer.eos_token_id
    stopped = [c for c in res if c.finish_reason == "stop"]
    assert 5 <= len(stopped) < len(res)
    for c in res:
        assert eos not in c.response_ids[:-1]
        np.testing.assert_allclose(c.logprobs, -math.log(vocab), atol=1e-5)
        if c.finish_reason == "stop":
            assert c.response_ids[-1] == eos and c.extra["stop_by"] == "eos"
            assert "<eos>" not in c.text
        else:
            assert len(c.response_ids) == 40


def test_padding_batch_equals_one_at_a_time(engine: HFEngine) -> None:
    prompts = _prompts(engine) + [[7]]
    sp = SamplingParams(temperature=0.0, max_tokens=16)
    batched = engine.generate([GenerationRequest(p, 1, sp) for p in prompts])
    for p, comps in zip(prompts, batched, strict=True):
        alone = engine.generate([GenerationRequest(p, 1, sp)])[0][0]
        assert comps[0].response_ids == alone.response_ids
        np.testing.assert_allclose(comps[0].logprobs, alone.logprobs, atol=1e-5)
        np.testing.assert_allclose(engine.score(p, alone.response_ids), alone.logprobs, atol=1e-4)


def test_load_weights_is_strict_and_atomic(tiny: Path) -> None:
    eng = HFEngine(tiny, device="cpu")
    before = {k: v.clone() for k, v in eng.model.state_dict().items()}
    good = {k: v + 0.5 for k, v in before.items()}
    bad_missing = {k: v for k, v in good.items() if k != "model.layers.0.mlp.up_proj.weight"}
    bad_extra = {**good, "model.bogus.weight": torch.zeros(2)}
    bad_shape = {**good, "model.norm.weight": torch.zeros(3)}
    for bad in (bad_missing, bad_extra, bad_shape):
        with pytest.raises(ValueError):
            eng.load_weights(bad, version=1)
        for k, v in eng.model.state_dict().items():
            assert torch.equal(v, before[k]), f"{k} changed by a rejected push"
    assert eng.policy_version == 0
    # tied embeddings: lm_head.weight may be left out (it is the embedding)
    no_head = {k: v for k, v in good.items() if k != "lm_head.weight"}
    eng.load_weights(no_head, version=2)
    assert torch.equal(eng.model.lm_head.weight, good["model.embed_tokens.weight"])
    assert eng.policy_version == 2


def test_factory_builds_hf(tiny: Path) -> None:
    from rlbus.config import RlbusConfig
    from rlbus.rollout.engines.factory import build_engine

    cfg = RlbusConfig()
    cfg.rollout.device = "cpu"
    eng = build_engine(cfg, tiny)
    assert isinstance(eng, HFEngine) and eng.name == "hf"


def test_weight_push_over_gloo_swaps_weights(tiny: Path) -> None:
    import multiprocessing as mp

    from helpers_tiny import perturbed_model, push_weights_process

    from rlbus.messages import WeightAnnouncement
    from rlbus.weight_sync import free_port

    eng = HFEngine(tiny, device="cpu")
    prompt, response = [5, 6, 7, 13], [8, 9, 16, 4, 1]
    before = eng.score(prompt, response)
    expected_model = perturbed_model(tiny, seed=7)
    expected = response_logprobs(expected_model, [prompt], [response], eng.pad_id, 1.0)[0]

    ctx = mp.get_context("spawn")
    plans, done = ctx.Queue(), ctx.Queue()
    port = free_port()
    proc = ctx.Process(target=push_weights_process, args=(str(tiny), 7, port, 32 << 10, plans, done))
    proc.start()
    try:
        for version in (1, 2):
            fields = plans.get(timeout=60)
            assert len(fields["buckets"]) > 1  # small buckets: the multi-bucket path is exercised
            ann = WeightAnnouncement(
                run_id="t",
                version=version,
                epoch=0,
                master_addr="127.0.0.1",
                master_port=port,
                world_size=2,
                ranks={"r": 1},
                backend="gloo",
                **fields,
            )
            eng.receive_weights(ann, rank=1, timeout_s=30.0)
            assert eng.policy_version == version
            after = eng.score(prompt, response)
            np.testing.assert_allclose(after, expected, atol=1e-5)
            assert float(np.abs(after - before).max()) > 1e-3
        assert done.get(timeout=30) == "ok"
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
        eng.close()
    assert proc.exitcode == 0
    assert torch.equal(eng.model.lm_head.weight, expected_model.lm_head.weight)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("small_bucket", [False, True])
def test_compiled_decode_compiles_at_warm_up_only_and_decodes_as_eager(
    tiny: Path, small_bucket: bool
) -> None:
    """A partial fetch, a validation batch of one row, a longer prompt, a shorter budget and sampled rows after
    start-up reuse the graphs `warm_up` compiled (dynamo counts none new), greedy output equals the eager
    engine's, and sampled rows carry the log-probs the learner recomputes. Two graphs per row bucket (the
    decode step and the sampler): the fetch's rows, and with rollout.decode_small_bucket an eighth of them."""
    from torch._dynamo.utils import counters

    from rlbus.rollout.engines.decode_shapes import plan_decode_shapes

    torch._dynamo.reset()
    shapes = plan_decode_shapes(16, 24, 8, small_bucket=small_bucket)
    compiled = HFEngine(  # the sampler compiled too, as for a large vocabulary
        tiny,
        device="cpu",
        max_batch_rows=16,
        compiled_decode=True,
        decode_shapes=shapes,
        compile_sampler=True,
    )
    eager = HFEngine(tiny, device="cpu", max_batch_rows=16, compiled_decode=False)
    said: list[str] = []
    before = counters["stats"]["unique_graphs"]
    compiled.warm_up(said.append)
    at_start = counters["stats"]["unique_graphs"]
    buckets = 2 if small_bucket else 1
    assert shapes.row_buckets == ((2, 16) if small_bucket else (16,))
    assert at_start - before == 2 * buckets
    assert len(said) == 1 + buckets and said[1].startswith(f"[1/{buckets}] decode step for 16 rows")
    assert ("16, 2 rows" if small_bucket else "(16 rows") in said[0]
    tok = compiled.tokenizer
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    batches = [
        [GenerationRequest(tok.encode(p, add_special_tokens=False), 8, greedy) for p in ("12+3=", "7=")],
        [GenerationRequest(tok.encode("12+3=", add_special_tokens=False), 3, greedy)],
        [GenerationRequest(tok.encode("1+2+3+4+5+6+7+8+9=", add_special_tokens=False), 1, greedy)],
        [
            GenerationRequest(
                tok.encode("4*5=", add_special_tokens=False), 1, greedy.model_copy(update={"max_tokens": 3})
            )
        ],
    ]
    for requests in batches:
        got, want = compiled.generate(requests), eager.generate(requests)
        assert [[c.response_ids for c in r] for r in got] == [[c.response_ids for c in r] for r in want]
    prompt = tok.encode("12+3=", add_special_tokens=False)
    sampled = compiled.generate([GenerationRequest(prompt, 8, SamplingParams(temperature=0.7, max_tokens=8))])
    assert counters["stats"]["unique_graphs"] == at_start, "a batch after start-up compiled a new graph"
    comps = sampled[0]
    assert len({tuple(c.response_ids) for c in comps}) > 1  # sampled, not greedy
    recomputed = response_logprobs(
        eager.model, [prompt] * len(comps), [c.response_ids for c in comps], eager.pad_id, 0.7
    )
    for comp, want_lp in zip(comps, recomputed, strict=True):
        np.testing.assert_allclose(comp.logprobs, want_lp, atol=1e-4)


def test_recorded_decode_step_needs_a_gpu_and_a_known_name(tiny: Path) -> None:
    """rollout.decode_step=recorded records CUDA graphs: on the CPU the engine refuses it by the key's name
    rather than decode some other way; an unknown step name is refused too."""
    with pytest.raises(ValueError, match="rollout.decode_step=recorded"):
        HFEngine(tiny, device="cpu", compiled_decode=True, decode_step="recorded")
    with pytest.raises(ValueError, match="unknown decode step 'graphs'"):
        HFEngine(tiny, device="cpu", compiled_decode=True, decode_step="graphs")
    assert HFEngine(tiny, device="cpu", decode_step="recorded").compiled_decode is False  # eager on the CPU


def test_a_static_cache_writes_at_counters_of_its_own_that_a_recording_puts_back(tiny: Path) -> None:
    """transformers 5's static layers write at a device counter each update advances, not at the
    `cache_position` passed in: the recorded step's warm-up passes must put those counters back
    (`write_positions`), or a recording batch's keys land past its mask and past the cache's end."""
    import transformers
    from transformers import StaticCache

    from rlbus.rollout.engines.recorded_decode import write_positions

    engine = HFEngine(tiny, device="cpu", compiled_decode=False)
    cache = StaticCache(config=engine.model.config, max_cache_len=16)
    ids = torch.tensor([[5, 6, 7]])
    with torch.no_grad():
        engine.model(input_ids=ids, past_key_values=cache, cache_position=torch.arange(3), use_cache=True)
        counters = write_positions(cache)
        if int(transformers.__version__.split(".")[0]) < 5:
            assert counters == []  # 4.x writes at cache_position: nothing to put back
            return
        assert [int(c) for c in counters] == [3] * engine.model.config.num_hidden_layers
        engine.model(  # a step told to write at position 3 twice still advances the counters twice
            input_ids=ids[:, :1], past_key_values=cache, cache_position=torch.tensor([3]), use_cache=True
        )
        engine.model(
            input_ids=ids[:, :1], past_key_values=cache, cache_position=torch.tensor([3]), use_cache=True
        )
    assert [int(c) for c in counters] == [5] * engine.model.config.num_hidden_layers


def _compiling_in_background_and_eager(tiny: Path) -> tuple[HFEngine, HFEngine]:
    """An engine whose decode step compiles in the background (rollout.decode_step=recorded_then_inductor: eager
    until then on the CPU), one planned shape of 16 rows, and the eager engine its batches must match."""
    from rlbus.rollout.engines.decode_shapes import plan_decode_shapes

    engine = HFEngine(
        tiny,
        device="cpu",
        max_batch_rows=16,
        compiled_decode=True,
        decode_shapes=plan_decode_shapes(16, 24, 8),
        decode_step="recorded_then_inductor",
    )
    return engine, HFEngine(tiny, device="cpu", max_batch_rows=16, compiled_decode=False)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_decode_step_compiled_in_the_background_serves_from_the_next_batch(tiny: Path) -> None:
    """rollout.decode_step=recorded_then_inductor: `warm_up` returns before the decode step compiles (dynamo's
    compile lock, held here, keeps the compile from starting), batches meanwhile decode as the eager engine
    does, and once the compile ends the next batch takes the compiled step: the same tokens, the log-probs the
    learner recomputes, and no graph compiled in a batch (the compile ran on caches of its own)."""
    from torch._dynamo import convert_frame
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    engine, eager = _compiling_in_background_and_eager(tiny)
    tok = engine.tokenizer
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    requests = [
        GenerationRequest(tok.encode(p, add_special_tokens=False), 8, greedy) for p in ("12+3=", "7=")
    ]
    want = [[c.response_ids for c in r] for r in eager.generate(requests)]
    said: list[str] = []
    with convert_frame.compile_lock:  # the background compile cannot begin until this block ends
        engine.warm_up(said.append)
        compiling = engine.background_compile
        assert compiling is not None and compiling.state == "compiling"
        assert "in the background" in said[-1]
        assert [[c.response_ids for c in r] for r in engine.generate(requests)] == want
        assert compiling.state == "compiling"  # the batch above decoded eagerly
    assert compiling.wait(500), "the background compile did not end"
    assert compiling.state == "ready", said
    assert said[-1].startswith("decode step compiled in the background in")
    compiled_graphs = counters["stats"]["unique_graphs"]
    assert [[c.response_ids for c in r] for r in engine.generate(requests)] == want
    assert compiling.state == "taken"  # that batch took the compiled step
    prompt = tok.encode("12+3=", add_special_tokens=False)
    sampled = engine.generate([GenerationRequest(prompt, 8, SamplingParams(temperature=0.7, max_tokens=8))])
    assert counters["stats"]["unique_graphs"] == compiled_graphs, "a batch compiled a graph of its own"
    comps = sampled[0]
    recomputed = response_logprobs(
        eager.model, [prompt] * len(comps), [c.response_ids for c in comps], eager.pad_id, 0.7
    )
    for comp, want_lp in zip(comps, recomputed, strict=True):
        np.testing.assert_allclose(comp.logprobs, want_lp, atol=1e-4)


def test_a_failed_background_compile_leaves_the_first_step_serving(
    tiny: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A background compile that fails (on a shared GPU: out of memory) is told on the console with its reason,
    and the replica decodes on with the step it started with."""
    from rlbus.rollout.engines import background_compile

    def out_of_memory(*args: object, **kwargs: object) -> None:
        raise RuntimeError("CUDA out of memory (this test's)")

    monkeypatch.setattr(background_compile.torch, "compile", out_of_memory)
    engine, eager = _compiling_in_background_and_eager(tiny)
    said: list[str] = []
    engine.warm_up(said.append)
    compiling = engine.background_compile
    assert compiling is not None and compiling.wait(60) and compiling.state == "failed"
    assert "background compile failed (RuntimeError: CUDA out of memory" in said[-1]
    tok = engine.tokenizer
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    requests = [
        GenerationRequest(tok.encode(p, add_special_tokens=False), 8, greedy) for p in ("12+3=", "7=")
    ]
    got, want = engine.generate(requests), eager.generate(requests)
    assert [[c.response_ids for c in r] for r in got] == [[c.response_ids for c in r] for r in want]
    assert compiling.state == "failed"
