"""The embedded engine's GPU decode (make test-gpu): our own loop on planned static caches, compiled with CUDA
graphs at warm-up or recorded as CUDA graphs, decodes what the eager engine decodes, with behaviour log-probs
the learner recomputes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from helpers_tiny import build_tiny_model

from rlbus.messages import SamplingParams
from rlbus.modeling import response_logprobs
from rlbus.rollout.engines.base import GenerationRequest
from rlbus.rollout.engines.decode_shapes import plan_decode_shapes
from rlbus.rollout.engines.hf import HFEngine

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("decode_step", ["inductor", "recorded", "recorded_then_inductor"])
def test_compiled_static_decode_matches_eager_and_compiles_only_at_warm_up(
    tmp_path: Path, decode_step: str
) -> None:
    """Each decode step (rollout.decode_step: compiled by inductor, the eager kernels recorded, or compiled in
    the background while the recorded one serves)."""
    from torch._dynamo.utils import counters

    tiny = build_tiny_model(tmp_path / "tiny")
    shapes = plan_decode_shapes(64, 32, 24)
    fast = HFEngine(  # the sampler compiled too, as for a real vocabulary
        tiny,
        dtype="float32",
        device="cuda",
        max_batch_rows=64,
        compiled_decode=True,
        decode_shapes=shapes,
        compile_sampler=True,
        decode_step=decode_step,
    )
    eager = HFEngine(tiny, dtype="float32", device="cuda", max_batch_rows=64, compiled_decode=False)
    assert fast.compiled_decode and fast.static_decode and not eager.static_decode
    fast.warm_up(print)
    if (
        fast.background_compile is not None
    ):  # recorded_then_inductor: the batches below take the compiled step
        assert fast.background_compile.wait(300) and fast.background_compile.state == "ready"
    new_graphs = (
        0  # compiled inside fast.generate after warm-up (the reference log-probs below compile theirs)
    )

    def generate(batch: list[GenerationRequest]) -> list:
        nonlocal new_graphs
        before = counters["stats"]["unique_graphs"]
        out = fast.generate(batch)
        new_graphs += counters["stats"]["unique_graphs"] - before
        return out

    tok = fast.tokenizer
    prompts = [tok.encode(p, add_special_tokens=False) for p in ("12+3=", "7=", "1+2+3+4=", "99-5=")]
    greedy = SamplingParams(temperature=0.0, max_tokens=24)
    for batch in (
        [GenerationRequest(p, 16, greedy) for p in prompts],
        [GenerationRequest(prompts[0], 3, greedy)],
    ):
        got, want = generate(batch), eager.generate(batch)
        assert [[c.response_ids for c in r] for r in got] == [[c.response_ids for c in r] for r in want]
    sampled = generate(
        [GenerationRequest(p, 16, SamplingParams(temperature=1.0, max_tokens=24)) for p in prompts]
    )
    worst = 0.0
    for prompt, comps in zip(prompts, sampled, strict=True):
        ref = response_logprobs(
            fast.model, [prompt] * len(comps), [c.response_ids for c in comps], fast.pad_id, 1.0
        )
        for comp, want_lp in zip(comps, ref, strict=True):
            assert len(comp.logprobs) == len(comp.response_ids) == len(want_lp)
            if len(want_lp):
                worst = max(worst, float(np.abs(comp.logprobs - want_lp).max()))
    assert worst < 1e-3, worst
    # a weight push copies in place, so the captured graphs decode with the new weights
    generator = torch.Generator().manual_seed(1)
    pushed = {
        k: v.detach().cpu() + 0.05 * torch.randn(v.shape, generator=generator)
        for k, v in fast.model.named_parameters()  # tied weights once, as a push sends them
    }
    fast.load_weights(pushed, version=1)
    eager.load_weights(pushed, version=1)
    batch = [GenerationRequest(p, 16, greedy) for p in prompts]
    got, want = generate(batch), eager.generate(batch)
    assert [[c.response_ids for c in r] for r in got] == [[c.response_ids for c in r] for r in want]
    assert new_graphs == 0, "a batch after warm-up compiled a new graph"


def test_a_recording_made_on_a_real_batch_decodes_what_the_eager_engine_does(tmp_path: Path) -> None:
    """The recorded step records at a shape's first batch: without warm-up that is a real batch, whose keys
    must land where its mask says (the warm-up passes put the cache's write counters back; before, on
    transformers 5, they landed two positions on, and near the cache's end past it: a device-side assert)."""
    tiny = build_tiny_model(tmp_path / "tiny")
    recorded = HFEngine(
        tiny,
        dtype="float32",
        device="cuda",
        max_batch_rows=64,
        compiled_decode=True,
        decode_shapes=plan_decode_shapes(64, 32, 24),
        decode_step="recorded",
    )
    eager = HFEngine(tiny, dtype="float32", device="cuda", max_batch_rows=64, compiled_decode=False)
    tok = recorded.tokenizer
    prompts = [tok.encode(p, add_special_tokens=False) for p in ("12+3=", "7=", "1+2+3+4=", "99-5=")]
    batch = [GenerationRequest(p, 16, SamplingParams(temperature=0.0, max_tokens=24)) for p in prompts]
    for _ in range(2):  # the recording batch, then a replay
        got, want = recorded.generate(batch), eager.generate(batch)
        assert [[c.response_ids for c in r] for r in got] == [[c.response_ids for c in r] for r in want]
