"""Reward implementations, chosen by `reward.type`: task verifiers, a user function, an HTTP endpoint, a
reward model.

Every scorer maps (prompt, response, meta) -> (reward, correct). A batched one (``batched`` true) maps a
list of them in one call (`score_batch`): a reward model's forward pass, verl's batch reward manager. A user
function's scorer takes a group's items in one round trip to its sandbox (`score_each`), each item its own
outcome. A scorer that raises is recorded and scores `reward.on_error_score`; it never takes the service down.
"""

from __future__ import annotations

import json
import urllib.request
from typing import Any, Protocol

from rlbus.config.schema import RewardConfig, RewardModelConfig
from rlbus.reward.sandbox import error_text

Item = tuple[str, str, dict[str, Any]]  # (prompt, response, meta)


class Scorer(Protocol):
    name: str
    batched: bool

    def score(self, prompt: str, response: str, meta: dict[str, Any]) -> tuple[float, bool]: ...

    def score_batch(self, items: list[Item]) -> list[tuple[float, bool]]: ...


def _as_reward(value: Any) -> tuple[float, bool]:
    """User code may return a number, (reward, correct), {"reward": x, "correct": b}, or verl's
    {"score": x, "acc": b, ...}."""
    if isinstance(value, dict):
        key = "reward" if "reward" in value else "score"
        reward = float(value[key])
        return reward, bool(value.get("correct", value.get("acc", reward > 0)))
    if isinstance(value, tuple | list):
        return float(value[0]), bool(value[1])
    reward = float(value)
    return reward, reward > 0


class PerItemScorer:
    """A scorer of one item at a time; `score_batch` loops (the reward service batches only `batched` ones)."""

    name = "per-item"
    batched = False
    fast = False  # each call is cheap and bounded: a whole fetch may be scored in one thread hand-off

    def score(self, prompt: str, response: str, meta: dict[str, Any]) -> tuple[float, bool]:
        raise NotImplementedError

    def score_batch(self, items: list[Item]) -> list[tuple[float, bool]]:
        return [self.score(prompt, response, meta) for prompt, response, meta in items]


class TaskScorer(PerItemScorer):
    """The verifier of each example's own task (meta['task']): addition, countdown, gsm8k, ..."""

    name = "task"
    batched = False
    fast = True  # the built-in rule verifiers: string checks, no I/O

    def __init__(self, gsm8k_method: str = "strict", format_score: float = 0.0) -> None:
        self._tasks: dict[tuple[str, int], Any] = {}
        self._gsm8k = {"method": gsm8k_method, "format_score": format_score}  # reward.gsm8k_method, ...

    def score(self, prompt: str, response: str, meta: dict[str, Any]) -> tuple[float, bool]:
        from rlbus.tasks import get_task

        key = (str(meta.get("task", "addition")), int(meta.get("digits", 2)))
        if key not in self._tasks:
            extra = self._gsm8k if key[0] == "gsm8k" else {}
            self._tasks[key] = get_task(key[0], digits=key[1], **extra)
        return self._tasks[key].score(response, meta)


class RewardFunctionRefused(ValueError):
    """The user's function cannot serve: wrong signature, or a return value that is not a reward."""


# One sample in each calling convention, for the start-up check (a gsm8k-style row, as verl's examples have);
# extra_info says it is the probe, for functions that record their calls.
SAMPLE_PROMPT = "Natalia sold 48 clips in April and half as many in May. How many clips did she sell?"
SAMPLE_RESPONSE = "In May she sold 48 / 2 = 24 clips, so 48 + 24 = 72 in all. #### 72"
SAMPLE_META: dict[str, Any] = {
    "data_source": "openai/gsm8k",
    "ground_truth": "72",
    "answer": "72",
    "extra_info": {"split": "train", "index": 0, "rlbus_probe": True},
}


def _outcome(ok: bool, value: Any) -> tuple[float, bool] | str:
    """A reward from a call's (ok, value), or the error as text: the call's own, or why the value is not one."""
    if not ok:
        return str(value)
    try:
        return _as_reward(value)
    except Exception as exc:  # noqa: BLE001 - the user's values: anything can be wrong
        return error_text(exc)


class FunctionScorer:
    """A user function, run in a sandboxed child process: ours, fn(prompt, response, meta), or verl's
    compute_score(data_source, solution_str, ground_truth, extra_info) fed from the row's own fields."""

    def __init__(
        self, spec: str, timeout_s: float, memory_mb: int, signature: str = "auto", manager: str = "naive"
    ) -> None:
        from rlbus.reward.sandbox import Sandbox, resolve_callable, uses_verl_signature

        fn = resolve_callable(spec)  # fail at start, with the spec in the message, not on the first item
        self.verl = signature == "verl" or (signature == "auto" and uses_verl_signature(fn))
        self.batched = manager == "batch"
        self.name = f"function:{spec}"
        self.spec = spec
        self._check_signature(fn)
        self._sandbox = Sandbox(spec, timeout_s, memory_mb)

    def _sample_args(self) -> tuple[Any, ...]:
        meta = SAMPLE_META
        if self.verl:
            one: tuple[Any, ...] = (
                meta["data_source"],
                SAMPLE_RESPONSE,
                meta["ground_truth"],
                meta["extra_info"],
            )
        else:
            one = (SAMPLE_PROMPT, SAMPLE_RESPONSE, dict(meta))
        return tuple([a] for a in one) if self.batched else one

    def _check_signature(self, fn: Any) -> None:
        """The call this scorer will make must bind to the function's parameters."""
        import inspect

        try:
            sig = inspect.signature(fn)
        except (TypeError, ValueError):
            return  # a builtin or C callable: the sample call below tells
        try:
            sig.bind(*self._sample_args())
        except TypeError as exc:
            style = (
                "verl's compute_score(data_source, solution_str, ground_truth, extra_info)"
                if self.verl
                else ("fn(prompt, response, meta)")
            )
            raise RewardFunctionRefused(
                f"reward.function={self.spec}{sig} cannot be called as {style}"
                f"{' with lists (reward.manager=batch)' if self.batched else ''}: {exc}; "
                "fix its parameters or set reward.signature"
            ) from None

    def check(self) -> str | None:
        """Call the function once on a built-in sample, in its sandbox, before serving. A call that cannot bind
        or a value that is not a reward raises RewardFunctionRefused; any other error is returned (the
        function may need fields of the user's own rows) for the service to warn about."""
        args = self._sample_args()
        try:
            out = self._sandbox.call(*args)
        except TypeError as exc:
            raise RewardFunctionRefused(
                f"reward.function={self.spec} failed on a sample call: {exc}"
            ) from None
        except Exception as exc:  # noqa: BLE001 - user code: report, the service decides
            return f"{type(exc).__name__}: {exc}"
        try:
            if self.batched:
                if not isinstance(out, list | tuple) or len(out) != 1:
                    raise TypeError(f"returned {type(out).__name__}, not a list of 1 score for 1 response")
                _as_reward(out[0])
            else:
                _as_reward(out)
        except (TypeError, ValueError, KeyError, IndexError) as exc:
            raise RewardFunctionRefused(
                f"reward.function={self.spec} returned {out!r:.200} on a sample call, which is not a reward "
                f"({exc}); return a number, (reward, correct), or {{'score': x}}"
            ) from None
        return None

    def score_batch(self, items: list[Item]) -> list[tuple[float, bool]]:
        """verl's batch manager: compute_score(data_sources, solution_strs, ground_truths, extra_infos) with
        one list entry per response (ours: fn(prompts, responses, metas)); a list of scores back."""
        if self.verl:
            args: tuple[list[Any], ...] = (
                [m.get("data_source") for _, _, m in items],
                [r for _, r, _ in items],
                [m.get("ground_truth", m.get("answer")) for _, _, m in items],
                [m.get("extra_info") for _, _, m in items],
            )
        else:
            args = ([p for p, _, _ in items], [r for _, r, _ in items], [m for _, _, m in items])
        out = self._sandbox.call(*args)
        if not isinstance(out, list | tuple) or len(out) != len(items):
            raise TypeError(f"batch reward function returned {type(out).__name__}, not {len(items)} scores")
        return [_as_reward(v) for v in out]

    def _call_args(self, prompt: str, response: str, meta: dict[str, Any]) -> tuple[Any, ...]:
        if self.verl:
            ground_truth = meta.get("ground_truth", meta.get("answer"))
            return (meta.get("data_source"), response, ground_truth, meta.get("extra_info"))
        return (prompt, response, meta)

    def score(self, prompt: str, response: str, meta: dict[str, Any]) -> tuple[float, bool]:
        return _as_reward(self._sandbox.call(*self._call_args(prompt, response, meta)))

    def score_each(self, items: list[Item]) -> list[tuple[float, bool] | str]:
        """Each item's reward, or its error as text, from one round trip to the sandbox (the function is still
        called once per item). If the round trip itself fails (past the items' summed time limits, or the
        worker died), the items go again one call each, so the failure lands on its own item alone."""
        calls = [self._call_args(p, r, m) for p, r, m in items]
        try:
            outcomes = self._sandbox.call_each(calls)
        except Exception:  # noqa: BLE001 - a hang or a dead worker: find which item, one call at a time
            outcomes = [self._call_alone(args) for args in calls]
        return [_outcome(ok, value) for ok, value in outcomes]

    def _call_alone(self, args: tuple[Any, ...]) -> tuple[bool, Any]:
        try:
            return True, self._sandbox.call(*args)
        except Exception as exc:  # noqa: BLE001 - user code, a timeout, a dead worker: this item's error
            return False, error_text(exc)

    def close(self) -> None:
        self._sandbox.close()


class HTTPScorer(PerItemScorer):
    """POSTs {prompt, response, meta} as JSON; expects {"reward": x, "correct": b} back."""

    batched = False

    def __init__(self, url: str, timeout_s: float) -> None:
        self.name, self.url, self.timeout_s = f"http:{url}", url, timeout_s

    def score(self, prompt: str, response: str, meta: dict[str, Any]) -> tuple[float, bool]:
        body = json.dumps({"prompt": prompt, "response": response, "meta": meta}).encode()
        req = urllib.request.Request(self.url, data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:  # noqa: S310 - user-configured URL
            return _as_reward(json.loads(resp.read()))


class RewardModelScorer:
    """A sequence-classification model (one label) scores prompt + response as text, in micro-batches."""

    batched = True

    def __init__(self, cfg: RewardModelConfig, trust_remote_code: bool = False) -> None:
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        from rlbus.modeling import pick_device, torch_dtype

        path = cfg.model_path
        if path is None or not (path / "config.json").is_file():
            raise ValueError(f"reward_model.model.path={path} is not a Hugging Face checkpoint dir")
        self.name = f"model:{path.name}"
        self.cfg = cfg
        self.device = pick_device(cfg.device)
        self.tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.tokenizer.padding_side = "right"
        self.model = AutoModelForSequenceClassification.from_pretrained(
            path, dtype=torch_dtype(cfg.dtype), trust_remote_code=trust_remote_code
        ).to(self.device)
        self.model.eval()
        if self.model.config.num_labels != 1:
            raise ValueError(
                f"reward_model.model.path={path}: a reward model has one output label, this one has "
                f"{self.model.config.num_labels}"
            )
        if self.model.config.pad_token_id is None:  # it finds each row's last real token by the pad id
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self._torch = torch

    def score(self, prompt: str, response: str, meta: dict[str, Any]) -> tuple[float, bool]:
        return self.score_batch([(prompt, response, meta)])[0]

    def score_batch(self, items: list[Item]) -> list[tuple[float, bool]]:
        texts = [p + r for p, r, _ in items]
        out: list[tuple[float, bool]] = []
        step = self.cfg.micro_batch_size
        for start in range(0, len(texts), step):
            enc = self.tokenizer(
                texts[start : start + step],
                return_tensors="pt",
                padding=True,
                truncation=self.cfg.max_length is not None,
                max_length=self.cfg.max_length,
                add_special_tokens=False,
            ).to(self.device)
            with self._torch.no_grad():
                logits = self.model(**enc).logits[:, 0].float().cpu().tolist()
            out.extend((float(v), float(v) > self.cfg.correct_threshold) for v in logits)
        return out


def build_scorer(
    cfg: RewardConfig, reward_model: RewardModelConfig | None = None, trust_remote_code: bool = False
) -> Scorer:
    if cfg.type == "function":
        return FunctionScorer(
            cfg.function or "", cfg.timeout_s, cfg.memory_limit_mb, cfg.signature, cfg.manager
        )
    if cfg.type == "http":
        return HTTPScorer(cfg.http_url or "", cfg.timeout_s)
    if cfg.type == "model":
        if reward_model is None or not reward_model.enable:
            raise ValueError("reward.type=model needs reward_model.enable=true and reward_model.model.path")
        try:
            return RewardModelScorer(reward_model, trust_remote_code)
        except (OSError, ValueError) as exc:
            raise ValueError(f"reward model cannot load: {exc}") from exc
    return TaskScorer(cfg.gsm8k_method, cfg.format_score)
