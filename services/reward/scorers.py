"""Reward implementations, chosen by `reward.type`: task verifiers, a user function, an HTTP endpoint.

Every scorer maps (prompt, response, meta) -> (reward, correct). A scorer that raises is recorded and
scores `reward.on_error_score`; it never takes the service down.
"""

from __future__ import annotations

import json
import urllib.request
from typing import Any, Protocol

from rlbus.config.schema import RewardConfig


class Scorer(Protocol):
    name: str

    def score(self, prompt: str, response: str, meta: dict[str, Any]) -> tuple[float, bool]: ...


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


class TaskScorer:
    """The verifier of each example's own task (meta['task']): addition, countdown, gsm8k, ..."""

    name = "task"

    def __init__(self) -> None:
        self._tasks: dict[tuple[str, int], Any] = {}

    def score(self, prompt: str, response: str, meta: dict[str, Any]) -> tuple[float, bool]:
        from rlbus.tasks import get_task

        key = (str(meta.get("task", "addition")), int(meta.get("digits", 2)))
        if key not in self._tasks:
            self._tasks[key] = get_task(key[0], digits=key[1])
        return self._tasks[key].score(response, meta)


class FunctionScorer:
    """A user function, run in a sandboxed child process: ours, fn(prompt, response, meta), or verl's
    compute_score(data_source, solution_str, ground_truth, extra_info) fed from the row's own fields."""

    def __init__(self, spec: str, timeout_s: float, memory_mb: int, signature: str = "auto") -> None:
        from rlbus.reward.sandbox import Sandbox, resolve_callable, uses_verl_signature

        fn = resolve_callable(spec)  # fail at start, with the spec in the message, not on the first item
        self.verl = signature == "verl" or (signature == "auto" and uses_verl_signature(fn))
        self.name = f"function:{spec}"
        self._sandbox = Sandbox(spec, timeout_s, memory_mb)

    def score(self, prompt: str, response: str, meta: dict[str, Any]) -> tuple[float, bool]:
        if self.verl:
            ground_truth = meta.get("ground_truth", meta.get("answer"))
            return _as_reward(
                self._sandbox.call(meta.get("data_source"), response, ground_truth, meta.get("extra_info"))
            )
        return _as_reward(self._sandbox.call(prompt, response, meta))

    def close(self) -> None:
        self._sandbox.close()


class HTTPScorer:
    """POSTs {prompt, response, meta} as JSON; expects {"reward": x, "correct": b} back."""

    def __init__(self, url: str, timeout_s: float) -> None:
        self.name, self.url, self.timeout_s = f"http:{url}", url, timeout_s

    def score(self, prompt: str, response: str, meta: dict[str, Any]) -> tuple[float, bool]:
        body = json.dumps({"prompt": prompt, "response": response, "meta": meta}).encode()
        req = urllib.request.Request(self.url, data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:  # noqa: S310 - user-configured URL
            return _as_reward(json.loads(resp.read()))


def build_scorer(cfg: RewardConfig) -> Scorer:
    if cfg.type == "function":
        return FunctionScorer(cfg.function or "", cfg.timeout_s, cfg.memory_limit_mb, cfg.signature)
    if cfg.type == "http":
        return HTTPScorer(cfg.http_url or "", cfg.timeout_s)
    return TaskScorer()
