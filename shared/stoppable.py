"""Start-up work that a stop does not wait for: a service asked to stop while it loads or compiles ends at once.

`asyncio.to_thread` runs on the loop's default executor, whose threads `asyncio.run` joins before it returns:
a learner asked to stop in its compile warm-up (20-44 s on an H100) would wait it out, past `rlbus up`'s 15 s
grace, and be killed. Work started with `on_own_thread` runs on a daemon thread of its own that nothing joins,
and `unless_stopped` gives up waiting for a coroutine once the service's stop event is set.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import os
import sys
import threading
from collections.abc import Awaitable, Callable
from typing import ParamSpec, TypeVar

THREAD_PREFIX = "rlbus-start:"
P = ParamSpec("P")
T = TypeVar("T")


class StoppedDuringStart(Exception):
    """The service was asked to stop before the awaited start-up work finished."""


async def on_own_thread(fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
    """`fn(*args, **kwargs)` on a daemon thread; awaiting it may be abandoned (cancelled) and the process
    may then exit while `fn` still runs. For start-up work only: nothing it does must outlive the process."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[T] = loop.create_future()
    context = contextvars.copy_context()

    def settle(outcome: Callable[[], object]) -> None:
        if not done.done():  # an abandoned wait was cancelled: nothing to tell
            outcome()

    def work() -> None:
        try:
            reply = functools.partial(done.set_result, context.run(fn, *args, **kwargs))
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
            reply = functools.partial(done.set_exception, exc)
        try:
            loop.call_soon_threadsafe(settle, reply)
        except RuntimeError:  # the loop closed: the service stopped while this ran
            pass

    name = getattr(fn, "__qualname__", repr(fn))
    thread = threading.Thread(target=work, name=f"{THREAD_PREFIX}{name}", daemon=True)
    thread.start()
    return await done


def start_on_own_thread(fn: Callable[[], None], what: str) -> threading.Thread:
    """`fn()` on a daemon thread counted as start-up work (`unfinished_start_work`) while it runs: for work a
    service starts at its start and lets finish while it serves (a compile that a faster stand-in covers
    meanwhile); a process that ends before it does leaves at once (`leave_if_start_abandoned`)."""
    thread = threading.Thread(target=fn, name=f"{THREAD_PREFIX}{what}", daemon=True)
    thread.start()
    return thread


def unfinished_start_work() -> list[str]:
    """What `on_own_thread` started and is still running (thread names)."""
    return [t.name for t in threading.enumerate() if t.name.startswith(THREAD_PREFIX) and t.is_alive()]


def leave_if_start_abandoned(rc: int) -> None:
    """Ends the process at once (`os._exit(rc)`) while abandoned start-up work still runs: interpreter
    teardown beside a thread inside torch can crash, and exit hooks (inductor's compile workers) would wait
    for it. Nothing is lost: a service stopped during its start has nothing written yet."""
    if unfinished_start_work():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)


async def unless_stopped(stop: asyncio.Event, work: Awaitable[T]) -> T:
    """`work`'s result; if `stop` is set first, `work` is cancelled and StoppedDuringStart raised."""
    task = asyncio.ensure_future(work)
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        stopped.cancel()
    if task.done():
        return task.result()
    task.cancel()
    try:
        await task
    except (asyncio.CancelledError, Exception):  # abandoned: how it ended no longer matters
        pass
    raise StoppedDuringStart
