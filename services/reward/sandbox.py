"""Runs user reward code in a child process with a time and memory limit, so it can never take us down."""

from __future__ import annotations

import inspect
import multiprocessing as mp
import resource
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from rlbus.plugins import load_callable


def resolve_callable(spec: str) -> Any:
    """'pkg.module:function' or '/path/to/file.py:function' -> the function (verl users pass a file path:
    `custom_reward_function.path`); a ValueError naming the spec when it does not resolve."""
    return load_callable(spec, "reward function")


def uses_verl_signature(fn: Any) -> bool:
    """verl's compute_score(data_source, solution_str, ground_truth, extra_info=None), or its batch manager's
    (data_sources, solution_strs, ground_truths, extra_infos)."""
    try:
        params = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return False
    return bool(params) and params[0] in ("data_source", "data_sources")


def _limit_memory(memory_mb: int) -> None:
    limit = memory_mb * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def error_text(exc: BaseException) -> str:
    """How a failed reward call is recorded against its response: its type and message, at most 500 characters."""
    return f"{type(exc).__name__}: {exc}"[:500]


_resolved: dict[str, Any] = {}  # in the worker: the user's module runs once, not once per call


def _function(spec: str) -> Any:
    fn = _resolved.get(spec)
    if fn is None:
        fn = _resolved[spec] = resolve_callable(spec)
    return fn


def _call(spec: str, args: tuple[Any, ...]) -> Any:
    return _function(spec)(*args)


def _call_each(spec: str, calls: list[tuple[Any, ...]]) -> list[tuple[bool, Any]]:
    """Every call in the worker, each its own: (True, value) or (False, its error), so one raising item
    leaves its neighbours' results alone."""
    fn = _function(spec)
    out: list[tuple[bool, Any]] = []
    for args in calls:
        try:
            out.append((True, fn(*args)))
        except Exception as exc:  # noqa: BLE001 - user code can raise anything: that item's error
            out.append((False, error_text(exc)))
    return out


class SandboxTimeout(TimeoutError):
    pass


class Sandbox:
    """One worker process; a call that times out or crashes the worker gets a fresh worker next time."""

    def __init__(self, spec: str, timeout_s: float, memory_mb: int) -> None:
        self.spec, self.timeout_s, self.memory_mb = spec, timeout_s, memory_mb
        self._pool: ProcessPoolExecutor | None = None

    def _ensure(self) -> ProcessPoolExecutor:
        if self._pool is None:
            self._pool = ProcessPoolExecutor(
                max_workers=1,
                mp_context=mp.get_context("spawn"),
                initializer=_limit_memory,
                initargs=(self.memory_mb,),
            )
        return self._pool

    def _reset(self) -> None:
        if self._pool is not None:
            for proc in list(getattr(self._pool, "_processes", {}).values()):
                proc.kill()  # our own worker, by its handle
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    def call(self, *args: Any) -> Any:
        return self._result(self._ensure().submit(_call, self.spec, args), self.timeout_s)

    def call_each(self, calls: list[tuple[Any, ...]]) -> list[tuple[bool, Any]]:
        """Many calls in one round trip to the worker (a round trip costs about a millisecond, more than a
        rule check), each call's outcome apart (`_call_each`); the wait is the sum of their time limits."""
        if not calls:
            return []
        future = self._ensure().submit(_call_each, self.spec, calls)
        return self._result(future, self.timeout_s * len(calls))

    def _result(self, future: Any, timeout_s: float) -> Any:
        try:
            return future.result(timeout=timeout_s)
        except FutureTimeout:
            self._reset()
            raise SandboxTimeout(f"reward function exceeded {timeout_s}s") from None
        except BrokenProcessPool as exc:
            self._reset()
            raise RuntimeError(f"reward worker died (memory limit {self.memory_mb} MB?): {exc}") from exc

    def close(self) -> None:
        self._reset()
