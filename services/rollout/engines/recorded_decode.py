"""The decode step recorded once per shape as a CUDA graph of the model's own kernels: no compile at start.

transformers' compiled decode step (inductor, in CUDA graphs) fuses a step's small kernels, but inductor
compiles every row bucket anew at start: 14.1 s for the learning bench's 75M model and 12-23 s a shape on an
H100 (2026-12-06), and a newcomer's first step waits for it. Recording the eager step as a CUDA graph
(`rollout.decode_step=recorded`) takes two warm-up passes and one recorded pass, and replaying it removes the
host's kernel launches; what it keeps is the eager kernels' count and memory traffic, which inductor fuses: on
an H100 (2026-12-07) at 75M and 512 rows it was ready in 4.9 s against 15.7 s, and decoded 1.65x slower.

transformers builds its masks without host syncs while a stream records (`is_tracing`), and the static cache,
the weights (`load_weights` copies in place) and the bucket's buffers keep their addresses, so one recording
serves the whole run.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
from transformers import StaticCache

WARM_UP_PASSES = 2  # eager passes on a side stream before recording: cuBLAS handles and workspaces made


def write_positions(cache: StaticCache) -> list[torch.Tensor]:
    """The cache's own write positions, where it has them: transformers 5's static layers write at a device
    counter (`cumulative_length`) that each update advances in place, not at the `cache_position` passed in
    (4.x), so a pass that is not the batch's step must put it back, or the batch's keys land past its mask and,
    near the cache's end, past its length (a device-side assert, H100, 2026-12-07)."""
    layers = getattr(cache, "layers", [])
    return [c for layer in layers if isinstance(c := getattr(layer, "cumulative_length", None), torch.Tensor)]


@dataclass
class RecordedStep:
    """One shape's graph and the buffers it reads and writes: inputs are copied in, logits read out."""

    graph: torch.cuda.CUDAGraph
    inputs: dict[str, torch.Tensor]
    logits: torch.Tensor


class RecordedDecodeStep:
    """Callable like the model's decode step (the keywords `StaticDecoder` passes), replaying one CUDA graph
    per (static cache, rows): the first call at a shape records it, later calls copy their inputs into its
    buffers and replay. Its logits are overwritten by the next call, so they are read before it."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self._steps: dict[tuple[int, int], RecordedStep] = {}
        self._pool: Any = None  # one memory pool for every shape's graph

    def __call__(
        self,
        *,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        past_key_values: StaticCache,
        cache_position: torch.Tensor,
        use_cache: bool = True,
    ) -> SimpleNamespace:
        inputs = {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": position_ids,
            "cache_position": cache_position,
        }
        key = (id(past_key_values), input_ids.shape[0])
        step = self._steps.get(key)
        if step is None:
            step = self._steps[key] = self._record(inputs, past_key_values)
        else:
            for name, value in inputs.items():
                step.inputs[name].copy_(value)
            step.graph.replay()
        return SimpleNamespace(logits=step.logits)

    def _record(self, inputs: dict[str, torch.Tensor], cache: StaticCache) -> RecordedStep:
        """Warm-up passes, then the recorded one, all on these inputs: each writes this position's keys and
        values into the cache, the same ones the step itself would write (the cache's write positions put back
        after each warm-up pass), so recording is this call's step."""
        static = {name: value.clone() for name, value in inputs.items()}
        counters = write_positions(cache)
        before = [counter.clone() for counter in counters]

        def forward() -> torch.Tensor:
            return self.model(**static, past_key_values=cache, use_cache=True).logits

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARM_UP_PASSES):
                forward()
                for counter, value in zip(counters, before, strict=True):  # a warm-up pass writes nowhere new
                    counter.copy_(value)
        torch.cuda.current_stream().wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # thread_local: a weight push received on another thread meanwhile does not void the recording
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            logits = forward()
        graph.replay()  # recording does not run the kernels: this is the call's step
        return RecordedStep(graph, static, logits)
