"""Service processes forked from one that has already imported torch and transformers.

A service spends 2-4 s of CPU importing torch and transformers before it does anything. `rlbus up`
starts four or more services on the same cores the run needs, and restarts any that dies, so every start
and every restart paid that again: on the 2-core CI machine a learner restart stalled training ~5 s, most
of it imports. Here one server process (Python's forkserver) imports them once and forks each service from
that state; a fork takes milliseconds. Nothing in the server touches CUDA, threads or sockets, so each
child starts as clean as a fresh interpreter, with its own environment and log file.

Compose and k8s start every service as a fresh process; `run.service_start=exec` does the same here.
"""

from __future__ import annotations

import atexit
import importlib
import multiprocessing
import os
import signal
import subprocess
import sys
from pathlib import Path

PRELOAD = ["rlbus.preload"]  # imported once in the server, inherited by every child
ENTRY_POINT = "rlbus.cli:main"  # what each child runs with its argv, as the `rlbus` console script does


def _context() -> multiprocessing.context.ForkServerContext:
    """Python's forkserver, told what to import once."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    return context


def start_server() -> None:
    """Starts the server now, without waiting for it: it imports PRELOAD (seconds, more on a machine whose
    disk cache is cold) while the launcher still prepares the run (its NATS server, users, streams), rather
    than after. The first fork waits for the imports to end."""
    from multiprocessing import forkserver

    _context()
    forkserver.ensure_running()


class ForkedService:
    """A service forked from the preloaded server, with the part of `subprocess.Popen` the launcher uses."""

    def __init__(self, argv: list[str], env: dict[str, str], log_path: Path) -> None:
        log_path.touch()  # exists once we return, as a Popen child's redirected output does
        self._process = _context().Process(
            target=_service_main, args=(argv, env, str(log_path)), name=argv[0], daemon=False
        )
        self._process.start()
        self.pid = int(self._process.pid or 0)
        self.args = argv

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return self._process.exitcode

    def send_signal(self, sig: int) -> None:
        if self._process.exitcode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _service_main(argv: list[str], env: dict[str, str], log_path: str) -> None:
    """In the forked child: become what `python -m rlbus.cli ARGV` with `env` would be, then run it."""
    os.setsid()  # its own session, as start_new_session gives a Popen child
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    sys.stderr.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    os.environ.clear()
    os.environ.update(env)
    sys.argv = [sys.executable, "-m", "rlbus.cli", *argv]
    signal.signal(signal.SIGINT, signal.default_int_handler)  # the server's choices are not the service's
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _apply_thread_count(env)
    module, function = ENTRY_POINT.split(":")
    code = 1
    try:
        code = getattr(importlib.import_module(module), function)(argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        atexit._run_exitfuncs()  # what interpreter exit would run (the forkserver child ends in os._exit)
        sys.stdout.flush()
        sys.stderr.flush()
    sys.exit(code)


def _apply_thread_count(env: dict[str, str]) -> None:
    """OMP_NUM_THREADS is read when torch loads, in the server: apply this service's value now."""
    threads = env.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        import torch

        torch.set_num_threads(int(threads))
