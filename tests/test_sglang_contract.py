"""SGLangEngine against a LIVE SGLang server: runs only when RLBUS_SGLANG_URL is set.

Start a server on the model these tests score against, e.g. the bundled tiny model:
    python -m sglang.launch_server --model-path shared/assets/tiny-addition --dtype float32 --port 30000
    RLBUS_SGLANG_URL=http://127.0.0.1:30000 pytest -m sglang tests/test_sglang_contract.py
Optional: RLBUS_SGLANG_MODEL (the model directory the server serves; default the bundled tiny model),
RLBUS_SGLANG_BACKEND (weight-group backend; default nccl with CUDA, else gloo), RLBUS_SGLANG_MASTER_ADDR
(this host as the server sees it; default 127.0.0.1), RLBUS_SGLANG_ATOL (log-prob tolerance; default 5e-3).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

URL = os.environ.get("RLBUS_SGLANG_URL")
pytestmark = [
    pytest.mark.sglang,
    pytest.mark.skipif(not URL, reason="RLBUS_SGLANG_URL is not set: these tests need a live SGLang server"),
]

ATOL = float(os.environ.get("RLBUS_SGLANG_ATOL", "5e-3"))
PROMPTS = ("12+34=", "7+8=", "55+21=")


@pytest.fixture(scope="module")
def model_dir() -> Path:
    from rlbus.tiny_model import ensure_default_model

    path = (
        Path(os.environ["RLBUS_SGLANG_MODEL"])
        if os.environ.get("RLBUS_SGLANG_MODEL")
        else ensure_default_model()
    )
    if not (path / "config.json").is_file():
        pytest.skip(f"RLBUS_SGLANG_MODEL={path} is not a model directory")
    return path


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Any:
    from rlbus.rollout.engines.sglang_engine import SGLangEngine

    eng = SGLangEngine(URL or "", model_path=model_dir)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def hf_model(model_dir: Path) -> torch.nn.Module:
    from rlbus.modeling import load_causal_lm

    return load_causal_lm(model_dir, "float32", "cpu", trainable=False)


@pytest.fixture(scope="module")
def prompts(model_dir: Path) -> list[list[int]]:
    from rlbus.modeling import load_tokenizer

    tok = load_tokenizer(model_dir)
    return [tok.encode(s, add_special_tokens=False) for s in PROMPTS]


def _max_diff(model: torch.nn.Module, prompts: list[list[int]], results: list, temp: float) -> float:
    from rlbus.modeling import response_logprobs

    worst = 0.0
    for prompt, comps in zip(prompts, results, strict=True):
        ref = response_logprobs(model, [prompt] * len(comps), [c.response_ids for c in comps], 0, temp)
        for c, r in zip(comps, ref, strict=True):
            assert len(c.logprobs) == len(c.response_ids) == len(r)
            if len(r):
                worst = max(worst, float(np.abs(c.logprobs - r).max()))
    return worst


@pytest.mark.parametrize(
    "temp,top_k", [(1.0, -1), (0.7, -1), (0.7, 3), (0.0, -1)], ids=["t1", "t0.7", "topk3", "greedy"]
)
def test_generate_logprobs_follow_the_convention(
    engine: Any, hf_model: Any, prompts: list, temp: float, top_k: int
) -> None:
    from rlbus.messages import SamplingParams
    from rlbus.rollout.engines.base import GenerationRequest

    sp = SamplingParams(temperature=temp, top_k=top_k, max_tokens=6)
    res = engine.generate([GenerationRequest(p, 3, sp) for p in prompts])
    assert [len(r) for r in res] == [3, 3, 3]
    assert _max_diff(hf_model, prompts, res, temp) < ATOL


def test_n_max_tokens_stops_and_eos(engine: Any, model_dir: Path, prompts: list) -> None:
    from rlbus.messages import SamplingParams
    from rlbus.modeling import load_tokenizer
    from rlbus.rollout.engines.base import GenerationRequest

    tok = load_tokenizer(model_dir)
    res = engine.generate([GenerationRequest(prompts[0], 5, SamplingParams(temperature=1.0, max_tokens=3))])[
        0
    ]
    assert len(res) == 5
    for c in res:
        assert 1 <= len(c.response_ids) <= 3
        if c.finish_reason == "stop":
            assert c.response_ids[-1] == tok.eos_token_id and c.extra["stop_by"] == "eos"
        else:
            assert c.finish_reason == "length" and len(c.response_ids) == 3
    stops = ["1", "5", "9"]
    sp = SamplingParams(temperature=1.0, max_tokens=8, stop=stops)
    for comps in engine.generate([GenerationRequest(p, 4, sp) for p in prompts]):
        for c in comps:
            assert not any(s in tok.decode(c.response_ids[:-1]) for s in stops)
            if c.extra.get("stop_by") == "stop_string":
                assert any(c.text.endswith(s) for s in stops)


def test_score_matches_recompute(engine: Any, hf_model: Any, prompts: list) -> None:
    from rlbus.modeling import response_logprobs

    response = [5, 9, 2]
    for temp in (1.0, 0.6):
        ref = response_logprobs(hf_model, [prompts[0]], [response], 0, temp)[0]
        np.testing.assert_allclose(engine.score(prompts[0], response, temp), ref, atol=ATOL)


async def test_weight_push_through_the_learners_pusher(
    engine: Any, hf_model: Any, prompts: list, nats_url: str, run_id: str, tmp_path: Path
) -> None:
    """The learner's real pusher (services/learner/weight_push.py) reaches a live SGLang replica: the
    replica heartbeats `per_tensor_wire`, is announced a `tensor_group`, and SGLang's own endpoints take
    one broadcast per tensor from it."""
    import asyncio
    import copy
    import time

    from rlbus.bus import Bus
    from rlbus.bus.roll_call import answer_roll_calls
    from rlbus.config import RlbusConfig
    from rlbus.learner.weight_push import WeightPusher
    from rlbus.logs import get_logger
    from rlbus.messages import Heartbeat, WeightAnnouncement, decode
    from rlbus.modeling import response_logprobs
    from rlbus.service import ServiceContext

    backend = os.environ.get("RLBUS_SGLANG_BACKEND") or ("nccl" if torch.cuda.is_available() else "gloo")
    device = torch.device("cuda" if backend == "nccl" else "cpu")
    addr = os.environ.get("RLBUS_SGLANG_MASTER_ADDR", "127.0.0.1")
    cfg = RlbusConfig(
        run={"id": run_id, "dir": tmp_path / "runs"},
        bus={"url": nats_url},
        trainer={"weight_sync_backend": backend, "weight_sync_host": addr, "weight_push_timeout_s": 120},
    )
    response = [5, 9, 2]
    bus = await Bus.open(cfg, name="contract-learner")
    state = await bus.state()
    ctx = ServiceContext(
        cfg, "learner", "learner", bus, state, asyncio.Event(), get_logger("contract-learner")
    )
    await state.heartbeat(
        Heartbeat(
            run_id=run_id,
            service="rollout",
            instance_id="sglang",
            time=time.time(),
            status="ready",
            stats={
                "weight_ranks": float(engine.weight_ranks),
                "per_tensor_wire": float(engine.per_tensor_weights),
            },
            device=engine.weight_place,
            incarnation="contract",
        )
    )
    await answer_roll_calls(bus.nc, bus.names, "sglang", "contract", get_logger("test-replica"))
    pusher = WeightPusher(ctx, device)
    await pusher.start()

    async def push(model: torch.nn.Module, version: int) -> None:
        named = [(n, p.detach().to(device)) for n, p in model.named_parameters()]
        sending = asyncio.create_task(pusher.push(lambda: iter(named), version))
        while True:  # the announcement, as the replica's weight loop would read it
            raw = await state.get_announcement()
            ann = decode(raw, WeightAnnouncement) if raw else None
            if ann is not None and ann.version == version:
                break
            await asyncio.sleep(0.05)
        assert ann.tensor_group is not None and "sglang" in ann.tensor_group.ranks
        receiving = asyncio.to_thread(engine.receive_weights, ann, ann.tensor_group.ranks["sglang"], 120.0)
        ok, _ = await asyncio.gather(sending, receiving)
        assert ok, pusher.status
        assert engine.policy_version == version

    before = engine.score(prompts[0], response)
    perturbed = copy.deepcopy(hf_model)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in perturbed.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.5 * (p.std() if p.numel() > 1 else 1.0))
    try:
        await push(perturbed, version=1)
        expected = response_logprobs(perturbed, [prompts[0]], [response], 0, 1.0)[0]
        after = engine.score(prompts[0], response)
        assert np.abs(after - before).max() > 0.1
        np.testing.assert_allclose(after, expected, atol=ATOL)
    finally:
        await push(hf_model, version=2)  # leave the server as we found it
        pusher.close()
        await bus.close()
    np.testing.assert_allclose(engine.score(prompts[0], response), before, atol=ATOL)
