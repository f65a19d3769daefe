"""The vLLM engine: vLLM's offline `LLM` (its engine core and workers in their own processes; this process
is the driver), behind the `RolloutEngine` interface.

Log-probs. vLLM returns, per sampled token, what its `logprobs_mode` says: `raw_logprobs` (its default)
is log_softmax(logits) *without* the temperature, and `processed_logprobs` is taken after temperature
*and* after top-k/top-p masking, i.e. renormalised over the kept tokens (vllm issue #42259 and friends).
Our convention (rlbus.rollout.engines.base) is log_softmax(logits / T) over the full vocabulary, so:

* we start vLLM with `logprobs_mode="processed_logprobs"`. With top_k off and top_p = 1 (the
  default sampling, and always for greedy, where vLLM uses T = 1) nothing is masked and the value is
  exactly log_softmax(logits / T): we take it as is, at no extra cost;
* with top-k or top-p active, the value vLLM has is renormalised, so we sample without log-probs and
  re-score the sampled tokens in one batched prefill (`prompt_logprobs`, which vLLM computes from the
  raw logits: log_softmax(logits) for T = 1, and the full-vocabulary row re-tempered here for T != 1).
  The T != 1 re-score moves a vocabulary-sized row per token to this process: fine for small vocabularies,
  slow for 150k ones; prefer top_k=-1/top_p=1 for RL (the default) or T = 1 with filtering.
  On GPU, processed log-probs make vLLM use its native sampler instead of FlashInfer's.

Weights. `receive_weights` drives vLLM's native RL weight-update API (`init_weight_transfer_engine`,
`start_weight_update`, `update_weights`, `finish_weight_update`) with the `rlbus` transfer engine that
`rlbus.rollout.engines.vllm_plugin` registers in every vLLM process: vLLM's workers themselves join the
learner's torch process group (gloo on CPU, nccl on GPU) and receive the buckets; the driver only sends
the announcement's metadata. The offline `LLM` runs one call at a time, and a lock keeps generation and
a swap apart, so no pause/resume is needed; the prefix cache is reset after every swap (cached KV from
old weights would otherwise leak into new generations).

Processes. vLLM's default layout is three processes per replica (this driver, an engine core, one worker per
rank), each importing torch and vLLM. On CPU with one rank we run the engine core and its worker inside this
process instead (`in_process`, vLLM's `VLLM_ENABLE_V1_MULTIPROCESSING=0` with its uniproc executor): measured
on a busy 2-core box with the tiny model, a replica starts in ~23 s instead of ~57 s (~11 s when idle) and
takes ~1.8 GB instead of ~3 GB; the auto OpenMP binding of the multiprocess layout (which pins every replica's worker to core 0, one
core reserved) does not apply. Multi-rank and GPU engines keep vLLM's multiprocess layout; an explicit
`VLLM_ENABLE_V1_MULTIPROCESSING` in the environment, or `in_process=`, decides over the default. In-process,
vLLM sets up a one-rank torch.distributed world, freezes its env cache and patches `torch.set_num_threads` in
this process: the patch is undone after start-up and the world is torn down by `close`.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from importlib.metadata import entry_points
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from rlbus.messages import SamplingParams, WeightAnnouncement
from rlbus.rollout.engines.base import Completion, GenerationRequest, RolloutEngine

if TYPE_CHECKING:
    from rlbus.config import RlbusConfig

PLUGIN_ENTRY_POINT = "rlbus_gloo"
TRANSFER_BACKEND = "rlbus"  # rlbus.rollout.engines.vllm_plugin.ENGINE_NAME (not imported: it imports vllm)
_RPC_MARGIN_S = 60.0  # the driver waits this much longer than the workers' own gloo/nccl deadline


def filters_tokens(sp: SamplingParams) -> bool:
    """True when top-k/top-p can mask tokens, i.e. when vLLM's processed log-probs are renormalised."""
    if sp.temperature <= 0:
        return False  # greedy: vLLM switches top-k/top-p off itself
    return sp.top_k > 0 or sp.top_p < 1.0


@contextlib.contextmanager
def _env(overrides: dict[str, str]) -> Iterator[None]:
    """Sets environment variables while vLLM spawns its processes (they inherit them), then restores ours."""
    old = {k: os.environ.get(k) for k in overrides}
    os.environ.update(overrides)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _check_plugin() -> None:
    """vLLM only finds our transfer engine through the installed entry point: fail early and say how to fix."""
    names = {ep.name for ep in entry_points(group="vllm.general_plugins")}
    if PLUGIN_ENTRY_POINT not in names:
        raise RuntimeError(
            f"the vLLM plugin entry point {PLUGIN_ENTRY_POINT!r} is not installed; run `pip install -e .` in the "
            'rlbus checkout (pyproject.toml declares it under [project.entry-points."vllm.general_plugins"])'
        )
    allowed = os.environ.get("VLLM_PLUGINS")
    if allowed is not None and PLUGIN_ENTRY_POINT not in allowed.split(","):
        raise RuntimeError(
            f"VLLM_PLUGINS={allowed!r} excludes {PLUGIN_ENTRY_POINT!r}; weight pushes would fail"
        )


def resolve_in_process(requested: bool | None, is_cpu: bool, tensor_parallel_size: int) -> bool:
    """Whether vLLM's engine core and worker run inside this process (see the module docstring)."""
    if requested is not None:
        return bool(requested)
    explicit = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    if explicit is not None:
        return explicit.strip().lower() in ("0", "false")
    return is_cpu and tensor_parallel_size == 1


def _position_logprob(position: Any, token: int) -> float:
    """One position's log-prob of `token` from vLLM's per-position mapping (dict or FlatLogprobs view)."""
    entry = position[token]
    return float(entry.logprob)


class VLLMEngine(RolloutEngine):
    """A vLLM replica: fast batched sampling; weight pushes received by vLLM's workers themselves."""

    name = "vllm"

    def __init__(
        self,
        model_path: str | Path,
        dtype: str = "float32",
        tensor_parallel_size: int = 1,
        gpu_memory_utilization: float = 0.5,
        max_num_seqs: int = 256,
        enforce_eager: bool = True,
        enable_prefix_caching: bool = True,
        seed: int = 0,
        max_model_len: int | None = None,
        trust_remote_code: bool = False,
        cpu_kv_cache_gib: int = 1,
        block_size: int | None = None,
        engine_kwargs: dict[str, Any] | None = None,
        in_process: bool | None = None,
    ) -> None:
        _check_plugin()
        import torch
        from vllm import LLM
        from vllm.config import WeightTransferConfig
        from vllm.platforms import current_platform

        self.model_path = Path(model_path)
        self.tensor_parallel_size = int(tensor_parallel_size)
        self.is_cpu = bool(current_platform.is_cpu())
        self.in_process = resolve_in_process(in_process, self.is_cpu, self.tensor_parallel_size)
        env = {
            "VLLM_WORKER_MULTIPROC_METHOD": os.environ.get("VLLM_WORKER_MULTIPROC_METHOD", "spawn"),
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0" if self.in_process else "1",
        }
        if self.is_cpu:
            env["VLLM_CPU_KVCACHE_SPACE"] = os.environ.get(
                "VLLM_CPU_KVCACHE_SPACE", str(int(cpu_kv_cache_gib))
            )
        if enforce_eager:
            # enforce_eager turns off vLLM's model compilation, but a few helpers (the sampler's rank count)
            # still torch.compile on first use: ~35 s of inductor per engine on a small CPU box.
            env.setdefault("TORCH_COMPILE_DISABLE", os.environ.get("TORCH_COMPILE_DISABLE", "1"))
        kwargs: dict[str, Any] = dict(
            model=str(self.model_path),
            tokenizer=str(self.model_path),
            dtype=dtype,
            tensor_parallel_size=self.tensor_parallel_size,
            max_num_seqs=int(max_num_seqs),
            enforce_eager=bool(enforce_eager),
            enable_prefix_caching=bool(enable_prefix_caching),
            seed=int(seed),
            trust_remote_code=bool(trust_remote_code),
            logprobs_mode="processed_logprobs",  # see the module docstring
            max_logprobs=-1,  # full-vocabulary prompt log-probs, for re-tempered scoring
            generation_config="vllm",  # no checkpoint sampling defaults (top_k=20, penalties) behind our back
            weight_transfer_config=WeightTransferConfig(backend=TRANSFER_BACKEND),
        )
        if not self.is_cpu:
            kwargs["gpu_memory_utilization"] = float(gpu_memory_utilization)
        if max_model_len is not None:
            kwargs["max_model_len"] = int(max_model_len)
        if block_size is not None:
            kwargs["block_size"] = int(block_size)  # CPU default 128: prefix caching only reuses full blocks
        kwargs.update(engine_kwargs or {})
        # In-process, TORCH_COMPILE_DISABLE (read by torch at import) comes too late: turn dynamo off around our
        # vLLM calls instead, as the env var does in vLLM's own processes.
        self._no_compile = bool(
            self.in_process and enforce_eager and os.environ.get("TORCH_COMPILE_DISABLE") is None
        )
        set_num_threads = torch.set_num_threads  # vLLM's CPU worker makes it a no-op (in-process: in ours)
        # In-process, vLLM's worker makes the one-rank default torch.distributed world here unless one exists.
        self._owns_dist = not (torch.distributed.is_available() and torch.distributed.is_initialized())
        try:
            with _env(env), self._quiet_compile():
                self._llm = LLM(**kwargs)
        finally:
            torch.set_num_threads = set_num_threads
        self.vocab_size = int(self._llm.llm_engine.model_config.get_vocab_size())
        self.policy_version = 0
        self._lock = threading.Lock()
        self._group_key: tuple | None = None
        self._closed = False

    def _quiet_compile(self) -> contextlib.AbstractContextManager[Any]:
        if not self._no_compile:
            return contextlib.nullcontext()
        import torch._dynamo

        return torch._dynamo.config.patch(disable=True)

    @classmethod
    def from_config(cls, cfg: RlbusConfig, model_path: str | Path) -> VLLMEngine:
        r = cfg.rollout
        return cls(
            model_path,
            dtype=cfg.model.dtype,
            tensor_parallel_size=r.tensor_model_parallel_size,
            gpu_memory_utilization=r.gpu_memory_utilization,
            max_num_seqs=r.max_num_seqs,
            enforce_eager=r.enforce_eager if r.enforce_eager is not None else not _cuda_available(),
            enable_prefix_caching=r.enable_prefix_caching,
            seed=r.seed,
            trust_remote_code=cfg.model.trust_remote_code,
        )

    @property
    def weight_ranks(self) -> int:
        return self.tensor_parallel_size

    # ------------------------------------------------------------------ generation

    def _vllm_params(self, sp: SamplingParams, n: int, logprobs: bool) -> Any:
        from vllm import SamplingParams as VSamplingParams

        return VSamplingParams(
            n=int(n),
            temperature=float(sp.temperature),
            top_p=float(sp.top_p),
            top_k=int(sp.top_k) if sp.top_k > 0 else 0,
            max_tokens=int(sp.max_tokens),
            stop=[s for s in sp.stop if s] or None,
            include_stop_str_in_output=True,  # like HFEngine: the text keeps the stop string
            seed=sp.seed,
            ignore_eos=bool(sp.ignore_eos),
            logprobs=0 if logprobs else None,
            skip_special_tokens=True,
        )

    def generate(self, requests: list[GenerationRequest]) -> list[list[Completion]]:
        """One vLLM call for the whole batch (each request's n samples), then one re-score call if needed."""
        from vllm.inputs import TokensPrompt

        results: list[list[Completion]] = [[] for _ in requests]
        live = [i for i, r in enumerate(requests) if r.sampling.max_tokens > 0 and r.n > 0]
        for i, r in enumerate(requests):
            if not r.prompt_ids:
                raise ValueError("empty prompt: generation needs at least one context token")
            if r.sampling.max_tokens <= 0:
                results[i] = [Completion([], np.zeros(0, np.float32), "", "length") for _ in range(r.n)]
        if not live:
            return results
        prompts = [TokensPrompt(prompt_token_ids=list(requests[i].prompt_ids)) for i in live]
        # vLLM refuses n > 1 for greedy; the n greedy samples are one sample, copied (as HFEngine gives).
        params = [
            self._vllm_params(
                requests[i].sampling,
                requests[i].n if requests[i].sampling.temperature > 0 else 1,
                not filters_tokens(requests[i].sampling),
            )
            for i in live
        ]
        with self._lock, self._quiet_compile():
            outputs = self._llm.generate(prompts, params, use_tqdm=False)
            rescore: list[tuple[int, int]] = []  # (request index, completion index)
            for i, out in zip(live, outputs, strict=True):
                for k, o in enumerate(sorted(out.outputs, key=lambda c: c.index)):
                    tokens = [int(t) for t in o.token_ids]
                    if filters_tokens(requests[i].sampling):
                        lp = np.zeros(len(tokens), np.float32)
                        rescore.append((i, k))
                    else:
                        lp = np.asarray(
                            [
                                _position_logprob(pos, t)
                                for pos, t in zip(cast(Any, o.logprobs), tokens, strict=True)
                            ],
                            dtype=np.float32,
                        )
                    reason = o.finish_reason if o.finish_reason in ("stop", "length", "abort") else "stop"
                    extra: dict[str, Any] = {}
                    if reason == "stop":
                        extra["stop_by"] = "stop_string" if isinstance(o.stop_reason, str) else "eos"
                    results[i].append(Completion(tokens, lp, o.text, reason, extra))
                if requests[i].sampling.temperature <= 0:
                    first = results[i][0]
                    results[i] += [
                        Completion(
                            list(first.response_ids),
                            first.logprobs.copy(),
                            first.text,
                            first.finish_reason,
                            dict(first.extra),
                        )
                        for _ in range(requests[i].n - 1)
                    ]
            if rescore:
                rows = [(requests[i].prompt_ids, results[i][k].response_ids) for i, k in rescore]
                temps = [requests[i].sampling.temperature for i, _ in rescore]
                for (i, k), lp in zip(rescore, self._score_rows(rows, temps), strict=True):
                    results[i][k].logprobs = lp
        return results

    # ------------------------------------------------------------------ scoring

    def score(self, prompt_ids: list[int], response_ids: list[int], temperature: float = 1.0) -> np.ndarray:
        with self._lock, self._quiet_compile():
            return self._score_rows([(prompt_ids, response_ids)], [temperature])[0]

    def _score_rows(
        self, rows: list[tuple[list[int], list[int]]], temperatures: list[float]
    ) -> list[np.ndarray]:
        """Log-probs of each response after its prompt, from one prefill (`prompt_logprobs`) per row.

        vLLM's prompt log-probs are log_softmax(raw logits) whatever the logprobs_mode; for T != 1 we ask
        for the whole vocabulary row and re-temper it: log_softmax(z / T) == log_softmax(log_softmax(z) / T).
        """
        from vllm import SamplingParams as VSamplingParams
        from vllm.inputs import TokensPrompt

        out: list[np.ndarray | None] = [None] * len(rows)
        todo: list[int] = []
        for j, (p, r) in enumerate(rows):
            if not p:
                raise ValueError("empty prompt: the first response token needs a context")
            if not r:
                out[j] = np.zeros(0, np.float32)
            else:
                todo.append(j)
        if todo:
            temps = [
                1.0 if temperatures[j] is None or temperatures[j] <= 0 else float(temperatures[j])
                for j in todo
            ]
            prompts = [TokensPrompt(prompt_token_ids=list(rows[j][0]) + list(rows[j][1])) for j in todo]
            params = [
                VSamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0 if t == 1.0 else -1)
                for t in temps
            ]
            results = self._llm.generate(prompts, params, use_tqdm=False)
            for j, t, res in zip(todo, temps, results, strict=True):
                p, r = rows[j]
                assert res.prompt_logprobs is not None  # asked for (prompt_logprobs=0 or -1)
                positions = res.prompt_logprobs[len(p) : len(p) + len(r)]
                if t == 1.0:
                    vals = [_position_logprob(pos, tok) for pos, tok in zip(positions, r, strict=True)]
                else:
                    vals = [self._retempered(pos, tok, t) for pos, tok in zip(positions, r, strict=True)]
                out[j] = np.asarray(vals, dtype=np.float32)
        return [o if o is not None else np.zeros(0, np.float32) for o in out]

    def _retempered(self, position: Any, token: int, temperature: float) -> float:
        row = np.full(self.vocab_size, -np.inf, dtype=np.float64)
        for tok, entry in position.items():
            if 0 <= int(tok) < self.vocab_size:
                row[int(tok)] = entry.logprob
        z = row / temperature
        m = np.max(z)
        return float(z[token] - (m + np.log(np.sum(np.exp(z - m)))))

    # ------------------------------------------------------------------ weights

    def _rpc(self, method: str, timeout_s: float, **kwargs: Any) -> list[Any]:
        return self._llm.collective_rpc(method, timeout=timeout_s + _RPC_MARGIN_S, kwargs=kwargs)

    def receive_weights(self, announcement: WeightAnnouncement, rank: int, timeout_s: float) -> None:
        """`rank` is this replica's base rank (announcement.ranks[replica_id]); TP worker t joins at rank + t."""
        a = announcement
        key = (a.epoch, a.master_addr, a.master_port, a.world_size, a.backend, int(rank))
        if a.backend == "nccl" and self.is_cpu:
            raise ValueError(
                "backend 'nccl' on vLLM-CPU would be a silent no-op; the learner must push over gloo"
            )
        with self._lock, self._quiet_compile():
            if self._group_key != key:
                self._group_key = None
                init_info = {
                    "master_address": a.master_addr,
                    "master_port": int(a.master_port),
                    "rank_offset": int(rank),
                    "world_size": int(a.world_size),
                    "backend": a.backend,
                    "epoch": int(a.epoch),
                    "timeout_s": float(timeout_s),
                }
                self._rpc("init_weight_transfer_engine", timeout_s, init_info=init_info)
                self._group_key = key
            update_info = {
                "names": list(a.names),
                "dtype_names": list(a.dtypes),
                "shapes": [list(s) for s in a.shapes],
                "buckets": [list(b) for b in a.buckets],
                "checksum": float(a.checksum),
                "version": int(a.version),
            }
            self._rpc("start_weight_update", timeout_s)
            try:
                # Workers receive and verify everything here; the model is untouched until finish.
                self._rpc("update_weights", timeout_s, update_info=update_info)
            except BaseException:
                self._group_key = None  # re-run init next time: rejoins if the group broke, a no-op if not
                raise
            self._rpc("finish_weight_update", timeout_s)
            self._llm.llm_engine.set_weight_version(str(a.version))
            self._llm.reset_prefix_cache()
            self.policy_version = int(a.version)

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Stops vLLM's engine core and workers (and their weight groups); safe to call twice."""
        if self._closed:
            return
        self._closed = True
        llm = getattr(self, "_llm", None)
        if llm is None:
            return
        with contextlib.suppress(Exception):
            llm.llm_engine.engine_core.shutdown()
        del self._llm, llm
        if self.in_process:  # the engine's one-rank world, model-parallel groups and env cache live here
            from vllm import envs
            from vllm.distributed.parallel_state import cleanup_dist_env_and_memory, destroy_model_parallel

            with contextlib.suppress(Exception):
                if self._owns_dist:
                    cleanup_dist_env_and_memory()
                else:  # a world that was here before vLLM stays
                    destroy_model_parallel()
                    envs.disable_envs_cache()


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()
