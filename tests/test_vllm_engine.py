"""VLLMEngine on real vLLM (CPU build), the tiny model: log-probs == the learner's recompute, a weight push
over a real gloo group from a separate learner-side process, n samples / stop strings / max tokens.

One engine for the whole module (vLLM starts in ~30 s). Log-prob tolerance: 1e-4 absolute in fp32 on CPU
(measured ~1e-5: vLLM's and transformers' kernels sum in different orders).
"""

from __future__ import annotations

import copy
import importlib.util
import multiprocessing as mp
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
import torch

from rlbus.messages import SamplingParams, WeightAnnouncement
from rlbus.modeling import load_causal_lm, load_tokenizer, response_logprobs
from rlbus.rollout.engines.base import Completion, GenerationRequest

# find_spec, not importorskip: collecting this file (e.g. under `make test`) must not import vLLM.
pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None, reason="vllm is not installed (make install)"
    ),
]
torch.set_num_threads(1)

ATOL = 1e-4
PROMPTS = ("12+34=", "7+8=", "55+21=")
LONG_PROMPT = " " * 40 + "12+34="  # 46 tokens, and the tiny model still answers with varied digits


@pytest.fixture(scope="module")
def model_dir() -> Path:
    from rlbus.tiny_model import ensure_default_model

    return ensure_default_model()


def _is_tracker(proc: psutil.Process) -> bool:
    """multiprocessing's resource tracker: one per spawning parent, by design alive until the parent exits."""
    try:
        return "resource_tracker" in " ".join(proc.cmdline())
    except psutil.Error:
        return True  # already gone


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Iterator[Any]:
    from rlbus.rollout.engines.vllm_engine import VLLMEngine

    before = {p.pid for p in psutil.Process().children(recursive=True)}
    # block_size 32 (CPU default 128 > the tiny model's context) so prefix caching really reuses KV blocks
    eng = VLLMEngine(model_dir, dtype="float32", max_num_seqs=32, seed=0, block_size=32)
    try:
        yield eng
    finally:
        eng.close()
        leaked = [
            p for p in psutil.Process().children(recursive=True) if p.pid not in before and not _is_tracker(p)
        ]
        gone, alive = psutil.wait_procs(leaked, timeout=15)
        assert not alive, f"vLLM processes left behind: {[(p.pid, p.name()) for p in alive]}"


@pytest.fixture(scope="module")
def hf_model(model_dir: Path) -> torch.nn.Module:
    return load_causal_lm(model_dir, "float32", "cpu", trainable=False)


@pytest.fixture(scope="module")
def prompts(model_dir: Path) -> list[list[int]]:
    tok = load_tokenizer(model_dir)
    return [tok.encode(s, add_special_tokens=False) for s in PROMPTS]


def _max_diff(
    model: torch.nn.Module, prompts: list[list[int]], results: list[list[Completion]], temp: float
) -> float:
    worst = 0.0
    for prompt, comps in zip(prompts, results, strict=True):
        ref = response_logprobs(model, [prompt] * len(comps), [c.response_ids for c in comps], 0, temp)
        for c, r in zip(comps, ref, strict=True):
            assert c.logprobs.dtype == np.float32
            assert len(c.logprobs) == len(c.response_ids) == len(r)
            if len(r):
                worst = max(worst, float(np.abs(c.logprobs - r).max()))
    return worst


# ---------------------------------------------------------------------------------------------- (a) log-probs


@pytest.mark.parametrize(
    "sp",
    [
        SamplingParams(temperature=1.0, max_tokens=8),
        SamplingParams(temperature=0.7, max_tokens=8),
        SamplingParams(temperature=0.7, top_k=3, max_tokens=8),
        SamplingParams(temperature=1.3, top_p=0.8, max_tokens=8),
        SamplingParams(temperature=0.0, max_tokens=8),
    ],
    ids=["t1", "t0.7", "t0.7-topk3", "t1.3-topp0.8", "greedy"],
)
def test_behaviour_logprobs_equal_learner_recompute(
    engine: Any, hf_model: Any, prompts: list, sp: Any
) -> None:
    res = engine.generate([GenerationRequest(p, 4, sp) for p in prompts])
    assert [len(r) for r in res] == [4, 4, 4]
    assert _max_diff(hf_model, prompts, res, sp.temperature) < ATOL


def test_mixed_batch_each_request_keeps_its_convention(engine: Any, hf_model: Any, prompts: list) -> None:
    # one vLLM call holding exact (processed) rows, re-scored (top-k/top-p) rows and a greedy row
    sps = [
        SamplingParams(temperature=0.8, top_k=4, max_tokens=6),
        SamplingParams(temperature=1.2, max_tokens=6),
        SamplingParams(temperature=0.0, max_tokens=6),
    ]
    res = engine.generate([GenerationRequest(p, 3, sp) for p, sp in zip(prompts, sps, strict=True)])
    for p, comps, sp in zip(prompts, res, sps, strict=True):
        assert _max_diff(hf_model, [p], [comps], sp.temperature) < ATOL


def test_top_k_changes_sampling_not_the_recorded_logprob(engine: Any, hf_model: Any, prompts: list) -> None:
    # top_k=1 makes every step certain, yet the recorded value is log_softmax(logits/T) over the full vocab
    greedy = engine.generate(
        [GenerationRequest(p, 1, SamplingParams(temperature=0.0, max_tokens=6)) for p in prompts]
    )
    top1 = engine.generate(
        [GenerationRequest(p, 2, SamplingParams(temperature=0.5, top_k=1, max_tokens=6)) for p in prompts]
    )
    for g, t in zip(greedy, top1, strict=True):
        for c in t:
            assert c.response_ids == g[0].response_ids
            assert float(c.logprobs.max()) < 0
    assert _max_diff(hf_model, prompts, top1, 0.5) < ATOL


def test_score_matches_recompute(engine: Any, hf_model: Any, prompts: list) -> None:
    response = [5, 9, 2]
    for temp in (1.0, 0.6):
        got = engine.score(prompts[0], response, temp)
        ref = response_logprobs(hf_model, [prompts[0]], [response], 0, temp)[0]
        np.testing.assert_allclose(got, ref, atol=ATOL)
    assert engine.score(prompts[0], [], 1.0).shape == (0,)


def test_greedy_and_eos_agree_with_hf_engine(engine: Any, model_dir: Path, prompts: list) -> None:
    from rlbus.rollout.engines.hf import HFEngine

    hf = HFEngine(model_dir, dtype="float32", device="cpu")
    sp = SamplingParams(temperature=0.0, max_tokens=8)
    ours = engine.generate([GenerationRequest(p, 2, sp) for p in prompts])
    theirs = hf.generate([GenerationRequest(p, 2, sp) for p in prompts])
    eos = hf.tokenizer.eos_token_id
    stopped = 0
    for a, b in zip(ours, theirs, strict=True):
        for x, y in zip(a, b, strict=True):
            assert (x.response_ids, x.finish_reason, x.text, x.extra) == (
                y.response_ids,
                y.finish_reason,
                y.text,
                y.extra,
            )
            np.testing.assert_allclose(x.logprobs, y.logprobs, atol=ATOL)
            if x.finish_reason == "stop":
                stopped += 1
                assert x.response_ids[-1] == eos and eos not in x.response_ids[:-1]
    assert stopped >= 2  # the addition model answers and ends with EOS


# ---------------------------------------------------------------------------------------------- (c) n, stops, max


def test_n_samples_max_tokens_and_eos(engine: Any, model_dir: Path, prompts: list) -> None:
    sp = SamplingParams(temperature=1.0, max_tokens=3)
    res = engine.generate([GenerationRequest(p, n, sp) for p, n in zip(prompts, (6, 1, 3), strict=True)])
    assert [len(r) for r in res] == [6, 1, 3]
    eos = load_tokenizer(model_dir).eos_token_id
    for comps in res:
        for c in comps:
            assert 1 <= len(c.response_ids) <= 3
            assert eos not in c.response_ids[:-1]
            if c.finish_reason == "stop":
                assert c.response_ids[-1] == eos and c.extra == {"stop_by": "eos"}
            else:
                assert c.finish_reason == "length" and len(c.response_ids) == 3
    assert len({tuple(c.response_ids) for c in res[0]}) >= 2  # n samples are independent draws
    empty = engine.generate([GenerationRequest(prompts[0], 2, SamplingParams(max_tokens=0))])
    assert [c.response_ids for c in empty[0]] == [[], []]
    assert engine.generate([]) == []


def test_stop_strings(engine: Any, hf_model: Any, model_dir: Path, prompts: list) -> None:
    tok = load_tokenizer(model_dir)
    stops = ["1", "5", "9"]
    sp = SamplingParams(temperature=1.0, max_tokens=8, stop=stops, seed=3)
    res = engine.generate([GenerationRequest(p, 8, sp) for p in prompts])
    n_stopped = 0
    for comps in res:
        for c in comps:
            full = tok.decode(c.response_ids, skip_special_tokens=True)
            assert not any(s in tok.decode(c.response_ids[:-1]) for s in stops)  # never runs past a stop
            if c.extra.get("stop_by") == "stop_string":
                n_stopped += 1
                assert c.finish_reason == "stop" and any(full.endswith(s) for s in stops)
                assert c.text == full  # the text keeps the stop string, as HFEngine's does
    assert n_stopped >= 3
    assert _max_diff(hf_model, prompts, res, 1.0) < ATOL


def test_seeded_requests_are_reproducible(engine: Any, prompts: list) -> None:
    sp = SamplingParams(temperature=1.0, max_tokens=8, seed=1234)
    a = engine.generate([GenerationRequest(prompts[0], 4, sp)])[0]
    b = engine.generate(
        [GenerationRequest(prompts[1], 2, SamplingParams()), GenerationRequest(prompts[0], 4, sp)]
    )[1]
    assert [c.response_ids for c in a] == [c.response_ids for c in b]


# ---------------------------------------------------------------------------------------------- (b) weight push


def _learner_side(model_dir: str, port: int, commands: Any, replies: Any) -> None:
    """A separate process playing the learner: perturbs the weights, saves them, pushes them with WeightSender."""
    import torch

    from rlbus.modeling import load_causal_lm
    from rlbus.weight_sync import WeightSender

    torch.set_num_threads(1)
    base = load_causal_lm(model_dir, "float32", "cpu", trainable=False)
    sender = WeightSender(backend="gloo", host="127.0.0.1", timeout_s=60.0)
    try:
        while (cmd := commands.get()) is not None:
            seed, scale, save_dir, epoch = cmd
            model = copy.deepcopy(base)
            gen = torch.Generator().manual_seed(seed)
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn(p.shape, generator=gen) * scale * (p.std() if p.numel() > 1 else 1.0))
            model.save_pretrained(save_dir)
            named = list(model.named_parameters())
            plan = sender.plan(named)
            replies.put(("plan", plan.announcement_fields()))
            if sender.epoch != epoch:
                sender.open(port, 2, epoch)
            sender.send(named, plan)
            replies.put(("sent", sender.last_send_seconds, sender.last_send_bytes))
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        replies.put(("error", repr(exc)))
    finally:
        sender.close()


def test_weight_push_changes_logprobs_to_the_senders(
    engine: Any, hf_model: Any, prompts: list, model_dir: Path, tmp_path: Path
) -> None:
    from rlbus.weight_sync import free_port

    ctx = mp.get_context("spawn")
    commands, replies = ctx.Queue(), ctx.Queue()
    port = free_port()
    proc = ctx.Process(target=_learner_side, args=(str(model_dir), port, commands, replies), daemon=True)
    proc.start()
    response = [5, 9, 2]  # a fixed sequence: scored after the first prompt
    seeded = SamplingParams(temperature=1.0, max_tokens=8, seed=77)
    # Longer than one KV block: the prefix cache holds it from before the push, which must not leak after.
    long_prompt = load_tokenizer(model_dir).encode(LONG_PROMPT, add_special_tokens=False)
    assert len(long_prompt) > 40

    def push(seed: int, version: int, corrupt: bool = False) -> Path:
        save = tmp_path / f"v{version}-{seed}"
        commands.put((seed, 0.5, str(save), 1))
        kind, fields = replies.get(timeout=120)
        assert kind == "plan", fields
        if corrupt:
            fields = {**fields, "checksum": fields["checksum"] + 1.0}
        ann = WeightAnnouncement(
            run_id="t",
            version=version,
            epoch=1,
            master_addr="127.0.0.1",
            master_port=port,
            world_size=2,
            ranks={"r0": 1},
            backend="gloo",
            **fields,
        )
        try:
            engine.receive_weights(ann, ann.ranks["r0"], timeout_s=60.0)
        finally:
            reply = replies.get(timeout=120)
            assert reply[0] == "sent", reply
        return save

    try:
        before = engine.score(prompts[0], response)
        gen_before = engine.generate([GenerationRequest(long_prompt, 4, seeded)])[0]

        save = push(seed=1, version=5)
        assert engine.policy_version == 5
        new_model = load_causal_lm(save, "float32", "cpu", trainable=False)
        expected = response_logprobs(new_model, [prompts[0]], [response], 0, 1.0)[0]
        after = engine.score(prompts[0], response)
        assert np.abs(after - before).max() > 0.1  # the push really changed the model...
        np.testing.assert_allclose(after, expected, atol=ATOL)  # ...to exactly the sender's weights
        gen_after = engine.generate([GenerationRequest(long_prompt, 4, seeded)])[0]
        assert [c.response_ids for c in gen_after] != [c.response_ids for c in gen_before]
        assert _max_diff(new_model, [long_prompt], [gen_after], 1.0) < ATOL  # no stale prefix-cache KV

        # An announcement whose checksum disagrees with what is sent is rejected before any weight moves.
        with pytest.raises(Exception, match="checksum"):
            push(seed=2, version=6, corrupt=True)
        assert engine.policy_version == 5
        np.testing.assert_allclose(engine.score(prompts[0], response), expected, atol=ATOL)

        # The same group (epoch) takes the next push.
        save = push(seed=3, version=7)
        newer = load_causal_lm(save, "float32", "cpu", trainable=False)
        np.testing.assert_allclose(
            engine.score(prompts[0], response),
            response_logprobs(newer, [prompts[0]], [response], 0, 1.0)[0],
            atol=ATOL,
        )
        assert engine.policy_version == 7
    finally:
        commands.put(None)
        proc.join(timeout=60)
        if proc.is_alive():
            proc.kill()
