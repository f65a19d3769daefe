"""The decode step that starts recorded and ends compiled: `rollout.decode_step=recorded_then_inductor`.

inductor's decode step decodes 1.65x faster than the recorded eager kernels (recorded_decode.py), but its
compile holds a replica 14 s at start at 75M and 12-23 s a shape at 0.5B on an H100, while recording takes 3-5 s
(2026-12-07). Here the replica records its eager step, says it is ready, and decodes with it while a thread of
its own compiles the step with inductor on a scratch cache of each row bucket; the first batch after that
records the compiled kernels as its CUDA graph and every later one replays it. The recording is ours, not
inductor's CUDA-graph trees: those are kept per thread, and a graph recorded on the compile's thread would not
serve the batches'.

The compile thread takes no lock a batch needs: it reads the weights (a push copying into them meanwhile only
changes what its scratch cache holds) and writes its own cache. The sampler (for a vocabulary where it is
compiled) draws from the device's random generator, which each batch seeds for itself, so its compile runs
under the engine's lock with the generator's state put back; the batches sample eagerly until the switch.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from transformers import StaticCache

from rlbus.logs import get_logger
from rlbus.rollout.engines.static_decode import Sampler, sample_tokens, sampler_settings, step_inputs

log = get_logger("rlbus.rollout.recorded_then_compiled")


class RecordedThenCompiled:
    """A decode step (called like the model, with the keywords `StaticDecoder` passes) and a sampler that run
    recorded and eager until `settle` finds the compile beside them done, and compiled from then on."""

    def __init__(self, model: Any, device: torch.device, sample: Sampler | None = None) -> None:
        self.model = model
        self.device = device
        self._on_gpu = device.type == "cuda"
        self._compiled_sample = sample
        # inductor's kernels without its CUDA graphs: we record them (on the CPU, where tests run it, called)
        self._compiled = torch.compile(model.__call__, dynamic=False)
        self._step: Callable[..., Any] = self._recorded(model) if self._on_gpu else model
        self._sample: Sampler = self._sample_aside
        # the compile puts the device's default generator back where it found it (dynamo and inductor keep
        # the RNG state across a compile), which would repeat a batch's draws: until the switch the batches
        # draw from a generator of their own, seeded as each batch is (`settle`)
        self._generator = torch.Generator(device)
        self._done = threading.Event()
        self._failed: str | None = None
        self._switched = False
        self._thread: threading.Thread | None = None

    def __call__(self, **inputs: Any) -> Any:
        return self._step(**inputs)

    def sample(
        self, logits: torch.Tensor, inv_temperature: torch.Tensor, noise: torch.Tensor, bias: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._sample(logits, inv_temperature, noise, bias)

    def _sample_aside(
        self, logits: torch.Tensor, inv_temperature: torch.Tensor, noise: torch.Tensor, bias: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return sample_tokens(logits, inv_temperature, noise, bias, self._generator)

    def _recorded(self, forward: Callable[..., Any]) -> Callable[..., Any]:
        from rlbus.rollout.engines.recorded_decode import RecordedDecodeStep

        return RecordedDecodeStep(self.model, forward=forward)

    def start(
        self, buckets: list[int], cache_len: int, engine_lock: threading.Lock, say: Callable[[str], None]
    ) -> None:
        """Compile the step for each row bucket on a thread of its own, then the sampler under `engine_lock`."""
        self._thread = threading.Thread(
            target=self._compile,
            args=(buckets, cache_len, engine_lock, say),
            name="decode-compile",
            daemon=True,  # a run that ends inside the compile does not wait for it
        )
        self._thread.start()

    def wait_compiled(self, timeout_s: float) -> bool:
        """Whether the compile beside the decode has ended (done or failed) within `timeout_s`."""
        return self._done.wait(timeout_s)

    @property
    def switched(self) -> bool:
        """Whether the batches decode with the compiled step now."""
        return self._switched

    def settle(self, seed: int) -> bool:
        """Before a batch of `seed`: once the compile is done, decode with its kernels from this batch on (True
        when this call switched); until then its draws come from our generator, seeded with `seed`."""
        if self._switched or not self._done.is_set() or self._failed is not None:
            self._generator.manual_seed(seed)
            return False
        self._step = self._recorded(self._compiled) if self._on_gpu else self._compiled
        if self._compiled_sample is not None:
            self._sample = self._compiled_sample
        self._switched = True  # the eager recording is dropped with its graphs
        return True

    def _compile(
        self, buckets: list[int], cache_len: int, engine_lock: threading.Lock, say: Callable[[str], None]
    ) -> None:
        t0 = time.monotonic()
        try:
            if self._on_gpu:
                torch.cuda.set_device(self.device)  # a new thread starts on the first GPU
            with torch.no_grad():  # as the batches decode: the graph's guards hold for them
                for rows in buckets:
                    logits = self._compile_step(rows, cache_len)
                    if self._compiled_sample is not None:
                        self._compile_sampler(logits, engine_lock)
        except Exception as exc:  # the replica keeps decoding recorded rather than stop
            self._failed = f"{type(exc).__name__}: {exc}"
            log.warning("the decode step's compile failed: decoding stays on the recorded step",
                        error=self._failed)  # fmt: skip
            say(f"compiling the decode step failed ({self._failed}): decoding stays on the recorded step")
        else:
            say(f"decode step for {', '.join(map(str, buckets))} rows compiled in {time.monotonic() - t0:.1f} s "
                "beside the recorded one: the next batch records its kernels")  # fmt: skip
        finally:
            self._done.set()

    def _compile_step(self, rows: int, cache_len: int) -> torch.Tensor:
        """One prefill and one compiled step on a scratch cache of this bucket's shape, the step's keywords made
        as the batches make them; the step's logits, laid out as the batches' are."""
        pad = torch.zeros((rows, 1), dtype=torch.long, device=self.device)
        full_mask = torch.zeros((rows, cache_len), dtype=torch.long, device=self.device)
        full_mask[:, :2] = 1
        cache = StaticCache(config=self.model.config, max_cache_len=cache_len)
        self.model(  # the cache's layers are made on their first write, as a batch's prefill makes them
            input_ids=pad,
            attention_mask=full_mask,
            position_ids=pad,
            past_key_values=cache,
            cache_position=torch.arange(1, device=self.device),
            use_cache=True,
        )
        inputs = step_inputs(pad[:, 0], full_mask, pad + 1, 0, torch.arange(1, 2, device=self.device))
        if self._on_gpu:  # the keywords' layout as the recording's buffers have it
            inputs = {name: value.clone() for name, value in inputs.items()}
        logits = self._compiled(**inputs, past_key_values=cache, use_cache=True).logits[:, -1]
        return logits.contiguous()

    def _compile_sampler(self, logits: torch.Tensor, engine_lock: threading.Lock) -> None:
        """The sampler's compile draws from the device's generator: no batch samples meanwhile, and the
        generator's state is put back."""
        sample = self._compiled_sample
        assert sample is not None
        eos = torch.zeros(1, dtype=torch.long, device=self.device)
        devices = [self.device] if self._on_gpu else []
        with engine_lock, torch.random.fork_rng(devices=devices):
            for ignore_eos in (False, True):  # one graph: the ban is a tensor
                sample(logits, *sampler_settings(1.0, ignore_eos, eos, logits.shape[-1], self.device))
