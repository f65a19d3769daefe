"""The embedded engine: plain transformers `generate` with a KV cache, no extra install, CPU or one GPU.

Behaviour log-probs come from generate's raw logits (log_softmax(logits / T) at the sampled token, in
float32), which is exactly what `rlbus.modeling.response_logprobs` recomputes on the same tokens: the
left-padded prompts here and the right-padded recompute both take position ids from the attention mask.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch
from transformers import GenerationConfig, StaticCache, StoppingCriteriaList

from rlbus.gqa_attention import GQA_SDPA_KERNELS, register_gqa_sdpa
from rlbus.logs import get_logger
from rlbus.messages import SamplingParams, WeightAnnouncement
from rlbus.modeling import (
    compile_pays,
    effective_temperature,
    load_causal_lm,
    load_tokenizer,
    parameter_count,
    pick_device,
    response_logprobs,
)
from rlbus.rollout.engines.background_compile import BackgroundCompile
from rlbus.rollout.engines.base import Completion, GenerationRequest, RolloutEngine
from rlbus.rollout.engines.decode_shapes import DecodeShapes, bucket_width, plan_decode_shapes
from rlbus.rollout.engines.fused_projections import fuse_projections as fuse_decoder_projections
from rlbus.rollout.engines.static_decode import (
    DecodeStepKind,
    StaticDecoder,
    decode_compile_config,
    make_decode_step,
    sampler_compile_pays,
)
from rlbus.rollout.engines.stop_strings import StopOnStrings, stop_window, tail_has_stop

if TYPE_CHECKING:
    from rlbus.config import RlbusConfig

log = get_logger("rlbus.rollout.hf")


def _bucket_rows(rows: int, cap: int) -> int:
    """Rows rounded up to a power of two (at most `cap`): padding rows cost less than a recompile."""
    return min(max(cap, rows), 1 << max(0, (rows - 1).bit_length()))


class HFEngine(RolloutEngine):
    """One transformers model in this process; weight pushes are copied straight into its parameters."""

    name = "hf"

    def __init__(
        self,
        model_path: str | Path,
        dtype: str = "float32",
        device: str = "auto",
        seed: int = 0,
        attn_implementation: str = "sdpa",
        max_batch_rows: int = 256,
        trust_remote_code: bool = False,
        compiled_decode: bool | None = None,
        gpu_memory_utilization: float = 1.0,
        decode_shapes: DecodeShapes | None = None,
        static_decode: bool | None = None,
        fuse_projections: bool = True,
        compile_sampler: bool | None = None,
        decode_step: DecodeStepKind = "inductor",
    ) -> None:
        self.model_path = Path(model_path)
        self.device = pick_device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        if self.device.type == "cuda" and gpu_memory_utilization < 1.0:
            # A learner may share this GPU: stay within our share (an allocation past it raises OOM here,
            # not in the learner).
            torch.cuda.set_per_process_memory_fraction(gpu_memory_utilization, self.device)
        # transformers' static KV cache with a CUDA-graph decode step, compiled or recorded (`decode_step`):
        # 4-5x the tokens/s of the dynamic cache on a GPU. With `decode_shapes`, every batch runs at one of its
        # row buckets on that bucket's own static cache, compiled by `warm_up`; without, rows and widths are
        # bucketed on the fly.
        # `static_decode` (default: with the compiled decode) runs a planned shape through our own loop
        # (static_decode.py) instead of `generate`.
        self._static_caches: dict[int, StaticCache] = {}
        if attn_implementation == "sdpa":
            # sdpa without copying the KV cache per query head under the padding mask (rlbus.gqa_attention)
            attn_implementation = register_gqa_sdpa()
        elif attn_implementation == GQA_SDPA_KERNELS:  # the same with SDPA's kernels in decode (the bench's)
            register_gqa_sdpa()
        self.tokenizer = load_tokenizer(self.model_path, trust_remote_code=trust_remote_code)
        self.model = load_causal_lm(
            self.model_path,
            dtype=dtype,
            device=self.device,
            trainable=False,
            attn_implementation=attn_implementation,
            trust_remote_code=trust_remote_code,
        )
        if fuse_projections:  # q/k/v and gate/up as one matrix product each, names unchanged
            fuse_decoder_projections(self.model)
        self.compiled_decode = (  # by default on a GPU, for a model whose compile pays (rlbus.modeling)
            self.device.type == "cuda" and compile_pays(parameter_count(self.model))
            if compiled_decode is None
            else bool(compiled_decode)
        )
        self.static_decode = self.compiled_decode if static_decode is None else bool(static_decode)
        self.decode_shapes = decode_shapes if self.compiled_decode or self.static_decode else None
        self.pad_id = int(self.tokenizer.pad_token_id)
        self.eos_ids = self._eos_ids()
        # A checkpoint's generation_config.json (repetition_penalty, top_k=20, ...) would change what is
        # sampled behind our back and break the log-prob convention: start from a clean one.
        self.model.generation_config = GenerationConfig(
            eos_token_id=sorted(self.eos_ids),
            pad_token_id=self.pad_id,
            bos_token_id=self.tokenizer.bos_token_id,
        )
        vocab = int(self.model.get_output_embeddings().weight.shape[0])  # the sampler is compiled if it pays
        sampler = sampler_compile_pays(vocab) if compile_sampler is None else compile_sampler
        self.decode_step = decode_step
        step = make_decode_step(self.model, decode_step, self.device) if self.compiled_decode else None
        self._decoder = StaticDecoder(self.model, step, compile_sampler=self.compiled_decode and sampler)
        self.background_compile: BackgroundCompile | None = None  # recorded_then_inductor, after warm_up
        self.seed = int(seed)
        self.max_batch_rows = max(1, int(max_batch_rows))
        self.policy_version = 0
        self._calls = 0
        self._lock = threading.Lock()  # generate and a weight swap never overlap
        self._receiver: Any = None  # rlbus.weight_sync.WeightReceiver, made on the first push
        self._ipc: Any = None  # rlbus.weight_ipc.IpcWeightReceiver, made on the first CUDA IPC push

    @classmethod
    def from_config(cls, cfg: RlbusConfig, model_path: str | Path) -> HFEngine:
        return cls(
            model_path,
            dtype=cfg.model.dtype,
            device=cfg.rollout.device,
            seed=cfg.rollout.seed,
            max_batch_rows=cfg.rollout.max_num_seqs,
            trust_remote_code=cfg.model.trust_remote_code,
            compiled_decode=None if cfg.rollout.enforce_eager is None else not cfg.rollout.enforce_eager,
            gpu_memory_utilization=cfg.rollout.gpu_memory_utilization,
            decode_step=cfg.rollout.decode_step,
            decode_shapes=plan_decode_shapes(  # the rows of one fetch, in chunks of max_num_seqs
                min(cfg.rollout.max_num_seqs, cfg.rollout.prompts_per_batch * cfg.rollout.n),
                cfg.data.max_prompt_length,
                cfg.data.max_response_length,
                small_bucket=cfg.rollout.decode_small_bucket,
            ),
        )

    def _eos_ids(self) -> set[int]:
        ids: set[int] = set()
        if self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        gen_eos = getattr(self.model.generation_config, "eos_token_id", None)
        if gen_eos is not None:
            ids.update(int(i) for i in ([gen_eos] if isinstance(gen_eos, int) else gen_eos))
        if not ids:
            raise ValueError(f"model at {self.model_path} defines no eos token; generation could never stop")
        return ids

    # ------------------------------------------------------------------ generation

    def generate(self, requests: list[GenerationRequest]) -> list[list[Completion]]:
        """Batches requests with equal sampling params; a seeded request runs alone so its seed alone decides it."""
        results: list[list[Completion]] = [[] for _ in requests]
        groups: dict[tuple, list[int]] = {}
        for i, req in enumerate(requests):
            sp = req.sampling
            key: tuple[Any, ...] = (
                sp.temperature,
                sp.top_p,
                sp.top_k,
                sp.max_tokens,
                tuple(sp.stop),
                sp.ignore_eos,
            )
            if sp.seed is not None:
                key = (*key, "seed", sp.seed, i)
            groups.setdefault(key, []).append(i)
        with self._lock:
            for idxs in groups.values():
                sampling = requests[idxs[0]].sampling
                rows = [(i, requests[i].prompt_ids) for i in idxs for _ in range(requests[i].n)]
                done: list[Completion] = []
                for start in range(0, len(rows), self.max_batch_rows):
                    chunk = rows[start : start + self.max_batch_rows]
                    if sampling.seed is not None:
                        seed = sampling.seed + start  # chunks of one seeded request still differ
                    else:
                        seed = self.seed * 1_000_003 + self._calls
                        self._calls += 1
                    done.extend(self._generate_rows([p for _, p in chunk], sampling, seed))
                for (i, _), comp in zip(rows, done, strict=True):
                    results[i].append(comp)
        return results

    def warm_up(self, say: Callable[[str], None]) -> None:
        """Compile (or record) the decode step for every row bucket now, largest first, saying each one's
        seconds."""
        shapes = self.decode_shapes
        if shapes is None:
            return
        buckets = sorted(shapes.row_buckets, reverse=True)
        verb, done = (
            ("compiling", "compiled") if self.decode_step == "inductor" else ("recording", "recorded")
        )
        say(f"{verb} the decode step for {len(buckets)} batch shapes ({', '.join(map(str, buckets))} rows "
            f"x {shapes.cache_len} positions), once, at start")  # fmt: skip
        # five tokens: the prefill's, then decode steps that compile, warm up and record the CUDA graph
        warm = SamplingParams(temperature=1.0, max_tokens=5, ignore_eos=True)
        for i, rows in enumerate(buckets, 1):
            t0 = time.monotonic()
            with self._lock:
                self._generate_rows([[self.pad_id]] * rows, warm, seed=0)
            say(f"[{i}/{len(buckets)}] decode step for {rows} rows {done} in {time.monotonic() - t0:.1f} s")
        if self.compiled_decode and self.decode_step == "recorded_then_inductor":
            self.background_compile = BackgroundCompile(self.model, shapes, self.pad_id, self.device, say)
            self.background_compile.start()

    def _take_compiled_step(self) -> None:
        """At a batch's start (under the lock): the decode step compiled in the background, once it is ready,
        in place of the recorded one (whose graphs go with it)."""
        compiling = self.background_compile
        if compiling is not None and (step := compiling.take()) is not None:
            self._decoder.step = step
            log.info(
                "decode step: the compiled one from this batch on", compile_s=round(compiling.seconds, 1)
            )

    def _generation_config(self, sp: SamplingParams, static_cache: bool = False) -> GenerationConfig:
        # Every sampling knob is set explicitly: unset ones would take transformers' defaults (top_k=50!).
        # Greedy leaves them out (generate warns about them and ignores them without sampling).
        knobs: dict[str, Any] = {"do_sample": False}
        if sp.temperature > 0:
            knobs = {
                "do_sample": True,
                "temperature": float(sp.temperature),
                "top_p": float(sp.top_p),
                "top_k": int(sp.top_k) if sp.top_k > 0 else 0,
                "min_p": None,
                "typical_p": 1.0,
                "epsilon_cutoff": 0.0,
                "eta_cutoff": 0.0,
            }
        return GenerationConfig(
            **knobs,
            max_new_tokens=sp.max_tokens,
            min_new_tokens=sp.max_tokens if sp.ignore_eos else 0,
            repetition_penalty=1.0,
            no_repeat_ngram_size=0,
            num_beams=1,
            num_return_sequences=1,
            eos_token_id=sorted(self.eos_ids),
            pad_token_id=self.pad_id,
            use_cache=True,
            output_logits=True,
            return_dict_in_generate=True,
            **({"cache_implementation": "static"} if static_cache else {}),
            **({"compile_config": decode_compile_config(self.device)} if self.compiled_decode else {}),
        )

    def _static_cache(self, rows: int) -> StaticCache:
        """The row bucket's own static cache (allocated on its first prefill), emptied for this batch."""
        shapes = cast(DecodeShapes, self.decode_shapes)
        cache = self._static_caches.get(rows)
        if cache is None:
            cache = self._static_caches[rows] = StaticCache(
                config=self.model.config, max_cache_len=shapes.cache_len
            )
        cache.reset()
        return cache

    @torch.no_grad()
    def _generate_rows(self, prompts: list[list[int]], sp: SamplingParams, seed: int) -> list[Completion]:
        if sp.max_tokens <= 0:
            return [Completion([], np.zeros(0, np.float32), "", "length") for _ in prompts]
        if any(len(p) == 0 for p in prompts):
            raise ValueError("empty prompt: generation needs at least one context token")
        real_rows = len(prompts)
        width = max(len(p) for p in prompts)
        cache: StaticCache | None = None
        if self.compiled_decode or self.static_decode:  # a few fixed shapes: one compiled step each
            shapes = self.decode_shapes
            rows = shapes.rows_for(real_rows) if shapes and shapes.fits(width, sp.max_tokens) else None
            if rows is not None:
                cache = self._static_cache(rows)
            else:  # outside the planned shapes (no plan, or longer than the run's lengths): compiles anew
                rows = _bucket_rows(real_rows, self.max_batch_rows)
                if shapes is not None and self.compiled_decode:
                    log.warning("a batch outside the decode shapes compiled at start: it may compile now",
                                rows=real_rows, prompt_width=width, max_tokens=sp.max_tokens)  # fmt: skip
            width = bucket_width(width)
            prompts = prompts + [prompts[0]] * (rows - real_rows)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for b, p in enumerate(prompts):  # LEFT padding: every row's next token is at the same column
            ids[b, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            mask[b, width - len(p) :] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        stops = [s for s in sp.stop if s]
        criteria = StoppingCriteriaList([StopOnStrings(self.tokenizer, stops, width)]) if stops else None
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):  # our seed, without touching the caller's RNG
            torch.manual_seed(seed)
            if cache is not None and not stops and self.static_decode:  # no host sync per token
                self._take_compiled_step()
                cache_len = cast(DecodeShapes, self.decode_shapes).cache_len
                done = self._decoder.run(ids, mask, cache, cache_len, sp, self.eos_ids, self.pad_id)
                return [
                    self._cut(g, done.logprobs[b], [], sp.ignore_eos)
                    for b, g in enumerate(done.tokens[:real_rows])
                ]
            out = cast(Any, self.model).generate(
                input_ids=ids,
                attention_mask=mask,
                generation_config=self._generation_config(
                    sp, static_cache=self.compiled_decode and cache is None
                ),
                stopping_criteria=criteria,
                past_key_values=cache,
            )
        gen = out.sequences[:, width:]
        temp = effective_temperature(sp.temperature)
        steps = min(gen.shape[1], len(out.logits))
        lp = torch.empty((gen.shape[0], steps), dtype=torch.float32, device=gen.device)
        for t in range(steps):  # one step at a time: never a [B, T, V] float copy
            logits = out.logits[t].float()
            if temp != 1.0:
                logits = logits / temp
            lp[:, t] = torch.log_softmax(logits, dim=-1).gather(-1, gen[:, t : t + 1]).squeeze(-1)
        gen_rows = gen[:real_rows, :steps].tolist()
        lp_rows = lp[:real_rows].cpu().numpy()
        return [self._cut(g, lp_rows[b], stops, sp.ignore_eos) for b, g in enumerate(gen_rows)]

    def _cut(
        self, tokens: list[int], logprobs: np.ndarray, stops: list[str], ignore_eos: bool = False
    ) -> Completion:
        """Keeps tokens up to and including the first EOS or the token that completes a stop string."""
        window = stop_window(stops)
        end, reason, stop_by = len(tokens), "length", None
        for t, tok in enumerate(tokens):
            if tok in self.eos_ids and not ignore_eos:
                end, reason, stop_by = t + 1, "stop", "eos"
                break
            if stops and tail_has_stop(self.tokenizer, tokens[max(0, t + 1 - window) : t + 1], stops):
                end, reason, stop_by = t + 1, "stop", "stop_string"
                break
        resp = tokens[:end]
        text = str(self.tokenizer.decode(resp, skip_special_tokens=True, clean_up_tokenization_spaces=False))
        extra = {"stop_by": stop_by} if stop_by else {}
        return Completion(resp, np.asarray(logprobs[:end], dtype=np.float32), text, reason, extra)

    # ------------------------------------------------------------------ scoring

    def score(self, prompt_ids: list[int], response_ids: list[int], temperature: float = 1.0) -> np.ndarray:
        with self._lock:
            return response_logprobs(self.model, [prompt_ids], [response_ids], self.pad_id, temperature)[0]

    # ------------------------------------------------------------------ weights

    def expected_weight_names(self) -> tuple[set[str], dict[str, str]]:
        """Names a push must carry, and the tied aliases (alias -> owner) it may carry or leave out."""
        state = self.model.state_dict()
        owners: dict[int, str] = {}
        aliases: dict[str, str] = {}
        for name, tensor in state.items():
            key = tensor.data_ptr()
            if key in owners:
                aliases[name] = owners[key]
            else:
                owners[key] = name
        return set(owners.values()), aliases

    def _check_and_map(self, received: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Strict load_state_dict semantics, checked before anything is copied (never a half swap)."""
        state = self.model.state_dict()
        required, aliases = self.expected_weight_names()
        # A tied alias sent on its own stands for its owner (some senders keep lm_head, not embed_tokens).
        names = set(received)
        for alias, owner in aliases.items():
            if alias in names and owner not in names:
                received = {**received, owner: received[alias]}
                names.add(owner)
        missing = sorted(required - names)
        unexpected = sorted(names - set(state))
        problems = []
        if missing:
            problems.append(f"missing {missing[:5]}{'...' if len(missing) > 5 else ''}")
        if unexpected:
            problems.append(f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}")
        for name in sorted(names & set(state)):
            if tuple(received[name].shape) != tuple(state[name].shape):
                problems.append(f"{name}: shape {tuple(received[name].shape)} != {tuple(state[name].shape)}")
        for alias, owner in aliases.items():
            if alias in received and owner in received and received[alias] is not received[owner]:
                if not torch.equal(received[alias].to(received[owner].dtype), received[owner]):
                    problems.append(f"tied {alias} differs from {owner}")
        if problems:
            raise ValueError("weight push does not match the model: " + "; ".join(problems))
        return {name: received[name] for name in required}

    def load_weights(self, received: dict[str, torch.Tensor], version: int) -> None:
        """Copies a full, checked set of weights in place (also used by tests and local reloads)."""
        mapped = self._check_and_map(received)
        state = self.model.state_dict()
        with self._lock, torch.no_grad():
            for name, src in mapped.items():
                state[name].copy_(src.to(device=state[name].device, dtype=state[name].dtype))
            self.policy_version = int(version)

    @property
    def weight_device(self) -> str:
        return str(self.device)

    @property
    def receives_while_generating(self) -> bool:
        return True  # the bytes arrive beside generation; load_weights takes the engine lock for the copy

    @property
    def supports_ipc(self) -> bool:
        return self.device.type == "cuda"

    def take_ipc_weights(self, announcement: WeightAnnouncement) -> dict[str, torch.Tensor]:
        from rlbus.weight_ipc import IpcWeightReceiver
        from rlbus.weight_sync import WeightSyncError, metas_from_announcement

        if announcement.ipc_buffer is None:
            raise WeightSyncError("the announcement names this replica for CUDA IPC but carries no buffer")
        if self._ipc is None:
            self._ipc = IpcWeightReceiver()
        received = self._ipc.receive(
            announcement.ipc_buffer.model_dump(), metas_from_announcement(announcement), announcement.checksum
        )
        self._check_and_map(received)  # a wrong name or shape is refused before the ack, never loaded
        return received

    def load_received(self, received: dict[str, torch.Tensor], version: int) -> None:
        self.load_weights(received, version)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the copies are done before `received` is freed

    def receive_weights(self, announcement: WeightAnnouncement, rank: int, timeout_s: float) -> None:
        """Joins (or reuses) the epoch's group, receives and verifies every tensor, then swaps them in.

        Generation keeps running while the bytes arrive; only the final copy takes the lock. Any failure
        (timeout, digest/checksum mismatch, a name or shape the model lacks) raises before a single
        parameter changes.
        """
        from rlbus.weight_sync import WeightReceiver, metas_from_announcement

        # NCCL lands on our GPU; gloo stages through host memory (load_weights moves it to our device).
        device = self.device if announcement.backend == "nccl" else torch.device("cpu")
        if self._receiver is not None and torch.device(self._receiver.device or "cpu") != device:
            self._close_receiver()
        if self._receiver is None:
            self._receiver = WeightReceiver(device=device)
        # connect() is a no-op for the group already joined and closes an older epoch's group itself.
        self._receiver.connect(
            announcement.master_addr,
            announcement.master_port,
            rank,
            announcement.world_size,
            backend=announcement.backend,
            epoch=announcement.epoch,
            timeout_s=timeout_s,
        )
        received = self._receiver.receive(
            metas_from_announcement(announcement), announcement.buckets, announcement.checksum
        )
        self.load_weights(received, announcement.version)

    def _close_receiver(self) -> None:
        receiver, self._receiver = self._receiver, None
        if receiver is not None:
            receiver.close()

    def close(self) -> None:
        self._close_receiver()
        if self._ipc is not None:
            self._ipc.close()
            self._ipc = None
