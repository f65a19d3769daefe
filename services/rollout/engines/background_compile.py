"""The decode step compiled on a thread of its own while a recorded one serves: a replica ready in seconds that
decodes at the compiled step's speed once the compile ends (`rollout.decode_step=recorded_then_inductor`).

inductor compiles the decode step in 12-23 s a shape on an H100, and a replica was not ready until it ended;
the model's own kernels recorded as a CUDA graph are ready in 3-5 s but decode 1.65x slower at the learning
bench's 75M shape (2026-12-07). Here the replica serves with the recorded step from its start (the eager model
on the CPU), while this thread compiles the step (inductor, without CUDA graphs of its own) on scratch static
caches of the planned shapes: the live caches are in use, and dynamo does not guard on a cache's addresses
(transformers marks them static, unguarded), so the graph serves the live caches too. The engine takes the
compiled step at the start of its next batch, recorded as a CUDA graph on each live cache in milliseconds.

The thread runs no sampler: its draws from the global generator would land inside the serving batches' own
seeded draws.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from typing import Any, Literal

import torch
from transformers import StaticCache

from rlbus.logs import get_logger
from rlbus.rollout.engines.decode_shapes import DecodeShapes
from rlbus.rollout.engines.static_decode import exercise_decode_step
from rlbus.stoppable import start_on_own_thread

log = get_logger("rlbus.rollout.background_compile")
CompileState = Literal["compiling", "ready", "taken", "failed"]


class BackgroundCompile:
    """Compiles `model`'s decode step for every planned shape on a thread, and hands it over once (`take`)."""

    def __init__(
        self, model: Any, shapes: DecodeShapes, pad_id: int, device: torch.device, say: Callable[[str], None]
    ) -> None:
        self.model = model
        self.shapes = shapes
        self.pad_id = pad_id
        self.device = device
        self.say = say
        self.state: CompileState = "compiling"
        self.seconds = 0.0
        self._step: Callable[..., Any] | None = None
        self._settled = threading.Event()

    def start(self) -> None:
        buckets = ", ".join(map(str, sorted(self.shapes.row_buckets, reverse=True)))
        self.say(f"compiling the decode step ({buckets} rows) in the background; the recorded step serves "
                 "until it is ready")  # fmt: skip
        start_on_own_thread(self._compile, "decode step compile")

    def take(self) -> Callable[..., Any] | None:
        """The compiled step the first time it is asked for once ready, else None (the caller keeps its own)."""
        if self.state != "ready":
            return None
        self.state = "taken"
        step, self._step = self._step, None
        return step

    def wait(self, timeout_s: float | None = None) -> bool:
        """Whether the compile ended (ready, taken or failed) within `timeout_s`: for benches timing the
        compiled step, and tests."""
        return self._settled.wait(timeout_s)

    def _compile(self) -> None:
        t0 = time.monotonic()
        try:
            step = self._compiled_step()
        except Exception as exc:  # noqa: BLE001 - the recorded step serves on; the reason is told
            self.state = "failed"
            log.warning("the decode step's background compile failed; the recorded step serves on",
                        error=f"{type(exc).__name__}: {exc}")  # fmt: skip
            self.say(f"decode step's background compile failed ({type(exc).__name__}: {exc}); the recorded "
                     "step serves on")  # fmt: skip
        else:
            self._step, self.seconds = step, time.monotonic() - t0
            self.state = "ready"
            self.say(
                f"decode step compiled in the background in {self.seconds:.1f} s; the next batch takes it"
            )
        finally:
            self._settled.set()

    @torch.no_grad()
    def _compiled_step(self) -> Callable[..., Any]:
        """The step compiled at every planned shape on scratch caches, and made callable as `StaticDecoder`
        calls it: recorded as a CUDA graph per live cache on a GPU."""
        compiled = torch.compile(self.model.__call__, fullgraph=True, dynamic=False)
        with torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext():
            for rows in sorted(self.shapes.row_buckets, reverse=True):
                scratch = StaticCache(config=self.model.config, max_cache_len=self.shapes.cache_len)
                exercise_decode_step(self.model, compiled, scratch, rows, self.shapes.cache_len, self.pad_id,
                                     self.device)  # fmt: skip
                del scratch
        if self.device.type != "cuda":
            return compiled
        from rlbus.rollout.engines.recorded_decode import RecordedDecodeStep

        return RecordedDecodeStep(compiled)
