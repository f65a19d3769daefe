"""The SGLang engine: a client of a running SGLang server's HTTP API (stdlib urllib, no extra install).

Log-probs. SGLang's `/generate` with `return_logprob` reports, per output token,
log_softmax(logits / T) over the full vocabulary, taken *before* top-k/top-p/min-p filtering (and T = 1
for greedy, which SGLang runs as top_k = 1 at temperature 1): exactly our convention
(rlbus.rollout.engines.base), so the values are taken as they come. The server must not run with
`SGLANG_RETURN_ORIGINAL_LOGPROB=1` (that switches to pre-temperature log-probs). Prompt (input) log-probs
are not temperature-scaled, so `score` at T != 1 asks for the full-vocabulary rows and re-tempers them.

Weights. SGLang's workers join a torch process group themselves (`/init_weights_update_group`, rank =
rank_offset + tp_rank, store prefix = group_name) and receive with `/update_weights_from_distributed`:
ONE broadcast PER TENSOR, in the order of `names`, from rank 0, with no header, trailer or checksum.
That is not rlbus.weight_sync's bucketed protocol, so the learner's pusher gives SGLang replicas a group of
their own (`WeightAnnouncement.tensor_group`, services/learner/per_tensor_push.py): the same rendezvous
as SGLang's `init_custom_process_group` (rlbus.weight_sync.per_tensor), then one broadcast per tensor in
announcement order. SGLang verifies no
checksum; a push is one HTTP call, so a broadcast failure leaves the old weights (SGLang loads after all
tensors of a call arrived), but a failure inside SGLang's load may leave them partly updated (its own
message says to discard the replica).
"""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from rlbus.messages import SamplingParams, TensorGroup, WeightAnnouncement
from rlbus.rollout.engines.base import Completion, GenerationRequest, RolloutEngine
from rlbus.weight_sync.per_tensor import per_tensor_group_name

if TYPE_CHECKING:
    from rlbus.config import RlbusConfig


class SGLangError(RuntimeError):
    """An SGLang endpoint answered with an error (HTTP status or `success: false`)."""


class SGLangEngine(RolloutEngine):
    """A replica served by an SGLang server; this process only talks HTTP to it."""

    name = "sglang"

    def __init__(
        self,
        url: str,
        model_path: str | Path | None = None,
        timeout_s: float = 600.0,
        api_key: str | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.model_path = Path(model_path) if model_path is not None else None
        self.timeout_s = float(timeout_s)
        self.api_key = api_key
        self.policy_version = 0
        self._lock = threading.Lock()
        self._group: tuple | None = None
        self._group_name = ""
        self._server_info: dict[str, Any] | None = None
        self._vocab_size: int | None = None

    @classmethod
    def from_config(cls, cfg: RlbusConfig, model_path: str | Path) -> SGLangEngine:
        if not cfg.rollout.sglang_url:
            raise ValueError(
                "rollout.name=sglang needs rollout.sglang_url (the SGLang server, e.g. http://host:30000)"
            )
        return cls(cfg.rollout.sglang_url, model_path=model_path)

    # ------------------------------------------------------------------ HTTP

    def _call(self, path: str, body: dict[str, Any] | None = None, timeout_s: float | None = None) -> Any:
        """POST JSON (GET when body is None); raises SGLangError with the server's message."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method="GET" if body is None else "POST")
        req.add_header("Content-Type", "application/json")
        if self.api_key:
            req.add_header("Authorization", f"Bearer {self.api_key}")
        try:
            with urllib.request.urlopen(req, timeout=timeout_s or self.timeout_s) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:2000]
            raise SGLangError(f"{path}: HTTP {exc.code}: {detail}") from exc
        except urllib.error.URLError as exc:
            raise SGLangError(f"{path}: cannot reach the SGLang server at {self.url}: {exc.reason}") from exc
        try:
            out = json.loads(raw) if raw else {}
        except json.JSONDecodeError:
            return raw.decode(errors="replace")
        if isinstance(out, dict) and out.get("success") is False:
            raise SGLangError(f"{path}: {out.get('message', out)}")
        return out

    def server_info(self) -> dict[str, Any]:
        if self._server_info is None:
            info = self._call("/get_server_info")
            self._server_info = info if isinstance(info, dict) else {}
        return self._server_info

    @property
    def weight_ranks(self) -> int:
        """SGLang's TP size: each TP worker takes one rank in the weight group."""
        try:
            return int(self.server_info().get("tp_size", 1) or 1)
        except SGLangError:
            return 1

    @property
    def weight_place(self) -> str:
        """The server's GPU as a place of its own (this client cannot read its UUID): the learner then
        reaches it by NCCL, never by CUDA IPC; a CPU server gets gloo."""
        try:
            device = str(self.server_info().get("device", "cuda"))
        except SGLangError:
            device = "cuda"
        return f"cuda:sglang@{self.url}" if device.startswith("cuda") else "cpu"

    # ------------------------------------------------------------------ generation

    @staticmethod
    def _sampling(sp: SamplingParams, seed: int | None) -> dict[str, Any]:
        params: dict[str, Any] = {
            "max_new_tokens": int(sp.max_tokens),
            "temperature": float(sp.temperature),
            "top_p": float(sp.top_p),
            "top_k": int(sp.top_k) if sp.top_k > 0 else -1,
            "min_p": 0.0,
            "repetition_penalty": 1.0,
            "frequency_penalty": 0.0,
            "presence_penalty": 0.0,
            "skip_special_tokens": True,
            "no_stop_trim": True,  # like HFEngine: the text keeps the stop string
        }
        stops = [s for s in sp.stop if s]
        if stops:
            params["stop"] = stops
        if seed is not None:
            params["sampling_seed"] = int(seed)  # honoured with --enable-deterministic-inference
        return params

    def generate(self, requests: list[GenerationRequest]) -> list[list[Completion]]:
        """One batched `/generate`: every request's prompt repeated n times (child k of a seeded one: seed + k)."""
        results: list[list[Completion]] = [[] for _ in requests]
        rows: list[int] = []
        input_ids: list[list[int]] = []
        params: list[dict[str, Any]] = []
        for i, r in enumerate(requests):
            if not r.prompt_ids:
                raise ValueError("empty prompt: generation needs at least one context token")
            if r.sampling.max_tokens <= 0:
                results[i] = [Completion([], np.zeros(0, np.float32), "", "length") for _ in range(r.n)]
                continue
            for k in range(r.n):
                rows.append(i)
                input_ids.append(list(r.prompt_ids))
                params.append(
                    self._sampling(r.sampling, None if r.sampling.seed is None else r.sampling.seed + k)
                )
        if not rows:
            return results
        body = {
            "input_ids": input_ids,
            "sampling_params": params,
            "return_logprob": True,
            "logprob_start_len": -1,
        }
        with self._lock:
            out = self._call("/generate", body)
        if isinstance(out, dict):
            out = [out]
        if len(out) != len(rows):
            raise SGLangError(f"/generate returned {len(out)} results for {len(rows)} rows")
        for i, item in zip(rows, out, strict=True):
            results[i].append(self._completion(item))
        return results

    @staticmethod
    def _completion(item: dict[str, Any]) -> Completion:
        meta = item.get("meta_info", {})
        # output_token_logprobs: [logprob, token_id, text|None] per generated token, EOS included.
        pairs = meta.get("output_token_logprobs") or []
        tokens = [int(p[1]) for p in pairs]
        logprobs = np.asarray([float(p[0]) for p in pairs], dtype=np.float32)
        finish = meta.get("finish_reason") or {}
        kind = finish.get("type", "stop") if isinstance(finish, dict) else str(finish)
        reason = kind if kind in ("stop", "length", "abort") else "stop"
        extra: dict[str, Any] = {}
        if reason == "stop":
            matched = finish.get("matched") if isinstance(finish, dict) else None
            extra["stop_by"] = "stop_string" if isinstance(matched, str) else "eos"
        if "weight_version" in meta:
            extra["weight_version"] = meta["weight_version"]
        return Completion(tokens, logprobs, str(item.get("text", "")), reason, extra)

    # ------------------------------------------------------------------ scoring

    def _vocab(self) -> int:
        if self._vocab_size is None:
            if self.model_path is None or not (self.model_path / "config.json").is_file():
                raise ValueError("score at temperature != 1 needs model_path (to know the vocabulary size)")
            cfg = json.loads((self.model_path / "config.json").read_text())
            self._vocab_size = int(cfg.get("vocab_size") or cfg.get("text_config", {}).get("vocab_size"))
        return self._vocab_size

    def score(self, prompt_ids: list[int], response_ids: list[int], temperature: float = 1.0) -> np.ndarray:
        """Prompt log-probs of prompt+response (SGLang's are log_softmax(logits)); re-tempered for T != 1."""
        if not prompt_ids:
            raise ValueError("empty prompt: the first response token needs a context")
        if not response_ids:
            return np.zeros(0, np.float32)
        temp = 1.0 if temperature is None or temperature <= 0 else float(temperature)
        body: dict[str, Any] = {
            "input_ids": list(prompt_ids) + list(response_ids),
            "sampling_params": {"max_new_tokens": 0, "temperature": 0.0},
            "return_logprob": True,
            "logprob_start_len": len(prompt_ids) - 1,
        }
        if temp != 1.0:
            body["top_logprobs_num"] = self._vocab()
        with self._lock:
            out = self._call("/generate", body)
        meta = (out[0] if isinstance(out, list) else out)["meta_info"]
        # One entry per input token from logprob_start_len on; the input ends with the response, so its
        # log-probs are the last len(response) entries (whatever SGLang does with the first one).
        n = len(response_ids)
        take = meta["input_token_logprobs"][-n:]
        if [int(t[1]) for t in take] != [int(t) for t in response_ids]:
            raise SGLangError("input_token_logprobs do not line up with the response tokens")
        if temp == 1.0:
            return np.asarray([float(t[0]) for t in take], dtype=np.float32)
        rows = meta["input_top_logprobs"][-n:]
        vals = []
        for row, tok in zip(rows, response_ids, strict=True):
            full = np.full(self._vocab(), -np.inf)
            for lp, tid, *_ in row:
                full[int(tid)] = float(lp)
            z = full / temp
            m = np.max(z)
            vals.append(float(z[tok] - (m + np.log(np.sum(np.exp(z - m))))))
        return np.asarray(vals, dtype=np.float32)

    # ------------------------------------------------------------------ weights

    @property
    def per_tensor_weights(self) -> bool:
        return True

    def receive_weights(self, announcement: WeightAnnouncement, rank: int, timeout_s: float) -> None:
        """Joins (once per group) and receives through SGLang's own endpoints, from the announcement's
        `tensor_group` (the learner's `PerTensorSender`: one broadcast per tensor, in `names` order)."""
        a = announcement
        g = a.tensor_group or TensorGroup(
            master_port=a.master_port,
            world_size=a.world_size,
            ranks=a.ranks,
            backend=a.backend,
            group_name=per_tensor_group_name(a.run_id, a.epoch),
        )
        key = (a.epoch, a.master_addr, g.master_port, g.world_size, g.backend, int(rank))
        with self._lock:
            if self._group != key:
                self._leave(timeout_s)
                self._call(
                    "/init_weights_update_group",
                    {
                        "master_address": a.master_addr,
                        "master_port": int(g.master_port),
                        "rank_offset": int(rank),
                        "world_size": int(g.world_size),
                        "group_name": g.group_name,
                        "backend": g.backend,
                    },
                    timeout_s=timeout_s,
                )
                self._group, self._group_name = key, g.group_name
            try:
                self._call(
                    "/update_weights_from_distributed",
                    {
                        "names": list(a.names),
                        "dtypes": list(a.dtypes),
                        "shapes": [list(s) for s in a.shapes],
                        "group_name": g.group_name,
                        "flush_cache": True,
                        "weight_version": str(a.version),
                    },
                    timeout_s=timeout_s,
                )
            except SGLangError:
                self._group = None  # a failed broadcast leaves the group unusable: rejoin on the next epoch
                raise
            self.policy_version = int(a.version)

    def _leave(self, timeout_s: float) -> None:
        if self._group is not None:
            try:
                self._call(
                    "/destroy_weights_update_group", {"group_name": self._group_name}, timeout_s=timeout_s
                )
            except SGLangError:
                pass  # the old group may already be gone with its learner
        self._group = None

    def close(self) -> None:
        """Leaves the weight group; the SGLang server itself is not ours to stop."""
        self._leave(30.0)
