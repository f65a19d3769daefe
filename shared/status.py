"""`rlbus status`: one table of a run, read from NATS: services, policy versions, stream depths, dead letters.

Three layers so each can be tested alone: `collect_status(bus)` reads a snapshot (a plain dict),
`render_status(snapshot)` turns it into text, `run_status(cfg, watch)` connects and prints (every 2 s
with `--watch`). Status only ever connects to a server that is already there: it never starts one.
"""

from __future__ import annotations

import asyncio
import math
import sys
import time
from pathlib import Path
from typing import Any

from rlbus.config import RlbusConfig

SERVICES = ("learner", "rollout", "reward", "ref")
ALIVE_S = 10.0
"""A heartbeat older than this (services beat every 2 s) marks the instance as not alive."""
WATCH_EVERY_S = 2.0
CONNECT_WAIT_S = 4.0


class RunNotFound(LookupError):
    """The server answers but holds nothing of this run (no state bucket)."""


async def _open_state(bus: Any) -> Any:
    """The run's RunState without creating anything (status must never create a run's buckets)."""
    from nats.js.errors import BucketNotFoundError, NotFoundError

    from rlbus.bus import RunState

    try:
        kv = await bus.js.key_value(bus.names.state_bucket)
    except (BucketNotFoundError, NotFoundError) as exc:
        raise RunNotFound(
            f"run {bus.run_id!r} has no state on this server (never started, or deleted)"
        ) from exc
    return RunState(kv, bus.js, bus.names, bus.nc)


async def _stage_info(bus: Any, stage: Any) -> dict[str, Any]:
    from nats.js.errors import NotFoundError

    out: dict[str, Any] = {
        "depth": None,
        "pending": None,
        "in_work": None,
        "consumers": [],
        "dead_letters": None,
    }
    try:
        out["depth"] = await bus.stream_depth(stage)
    except NotFoundError:
        return out
    try:
        infos = [i for stream in bus.names.streams(stage) for i in await bus.js.consumers_info(stream)]
        out["consumers"] = sorted({str(i.name) for i in infos})
        out["pending"] = sum(int(i.num_pending or 0) for i in infos)
        out["in_work"] = sum(int(i.num_ack_pending or 0) for i in infos)
    except Exception:  # older servers or a consumer deleted meanwhile: depth alone still says a lot
        pass
    try:
        out["dead_letters"] = await bus.dead_letter_count(stage)
    except NotFoundError:
        pass
    return out


async def collect_status(bus: Any, alive_s: float = ALIVE_S) -> dict[str, Any]:
    """A snapshot of the run `bus` is opened for: plain data (JSON-able), the input of `render_status`.

    Raises RunNotFound when the server has no state for the run.
    """
    from rlbus.bus import Stage

    state = await _open_state(bus)
    now = time.time()
    instances: list[dict[str, Any]] = []
    for service in SERVICES:
        for hb in await state.heartbeats(service):
            age = max(0.0, now - float(hb.time))
            instances.append(
                {
                    "service": hb.service,
                    "instance": hb.instance_id,
                    "status": hb.status,
                    "age_s": age,
                    "alive": age <= alive_s,
                    "policy_version": int(hb.policy_version),
                    "host": hb.host,
                    "stats": {k: float(v) for k, v in hb.stats.items()},
                }
            )
    # read after the heartbeats: versions only grow, so no replica in the snapshot is ahead of the learner
    # (read before, a push between the two reads showed a replica one version ahead, lag -1)
    policy_version = await state.get_policy_version(default=0)
    instances.sort(key=lambda r: (SERVICES.index(r["service"]), r["instance"]))
    stages = {stage.value: await _stage_info(bus, stage) for stage in Stage}
    try:
        dead_total: int | None = await bus.dead_letter_count()
    except Exception:
        dead_total = None
    return {
        "run_id": bus.run_id,
        "time": now,
        "policy_version": policy_version,
        "alive_s": alive_s,
        "instances": instances,
        "stages": stages,
        "dead_letters_total": dead_total,
    }


def _num(value: Any, fmt: str = "{:.0f}") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return fmt.format(value)


def _age(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f}s"
    if seconds < 3600:
        return f"{seconds / 60:.1f}m"
    return f"{seconds / 3600:.1f}h"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [
        max(len(header[i]), *(len(r[i]) for r in rows)) if rows else len(header[i])
        for i in range(len(header))
    ]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return [fmt.format(*header).rstrip(), *(fmt.format(*r).rstrip() for r in rows)]


_MAIN_STATS = ("tokens_per_s", "groups")


def render_status(snapshot: dict[str, Any]) -> str:
    """The status table as text (no colours, no terminal control: fit for logs and tests)."""
    version = int(snapshot.get("policy_version") or 0)
    instances = list(snapshot.get("instances") or [])
    alive = [r for r in instances if r.get("alive")]
    when = time.strftime("%H:%M:%S", time.localtime(float(snapshot.get("time") or time.time())))
    lines = [f"run {snapshot.get('run_id')}  |  learner policy version {version}  |  {when}"]
    extra = snapshot.get("progress")
    if extra:
        lines.append(f"last step: {extra}")
    lines.append("")
    if not alive:
        lines.append(
            f"NO SERVICES ALIVE: no heartbeat in the last {float(snapshot.get('alive_s') or ALIVE_S):.0f}s"
            + (f" ({len(instances)} stale instance(s) below)" if instances else "")
        )
    if instances:
        if not alive:
            lines.append("")
        rows = []
        for r in instances:
            stats = dict(r.get("stats") or {})
            lag = version - int(r["policy_version"]) if r["service"] == "rollout" else None
            others = " ".join(
                f"{k}={_num(v, '{:.4g}')}" for k, v in sorted(stats.items()) if k not in _MAIN_STATS
            )
            rows.append(
                [
                    r["service"],
                    r["instance"],
                    r.get("status") or "-",
                    _age(float(r["age_s"])),
                    "yes" if r.get("alive") else "NO",
                    str(r["policy_version"]),
                    _num(lag),
                    _num(stats.get("tokens_per_s")),
                    _num(stats.get("groups")),
                    others,
                ]
            )
        lines += _table(
            [
                "SERVICE",
                "INSTANCE",
                "STATUS",
                "HEARTBEAT",
                "ALIVE",
                "VERSION",
                "LAG",
                "TOK/S",
                "GROUPS",
                "STATS",
            ],
            rows,
        )
    lines.append("")
    stage_rows = []
    for stage, info in (snapshot.get("stages") or {}).items():
        stage_rows.append(
            [
                stage,
                _num(info.get("depth")),
                _num(info.get("pending")),
                _num(info.get("in_work")),
                _num(info.get("dead_letters")),
                ",".join(info.get("consumers") or []) or "-",
            ]
        )
    lines += _table(["STAGE", "DEPTH", "QUEUED", "IN-WORK", "DEAD-LETTERS", "CONSUMERS"], stage_rows)
    lines.append(f"dead letters in total: {_num(snapshot.get('dead_letters_total'))}")
    return "\n".join(lines) + "\n"


def _progress(cfg: RlbusConfig) -> str | None:
    from rlbus.metrics_log import progress_line, read_metrics

    try:
        rows = [r for r in read_metrics(Path(cfg.run.dir) / cfg.run.id) if "reward/mean" in r]
    except Exception:  # a half-written line: no progress line this time
        return None
    if not rows:
        return None
    return progress_line(int(rows[-1]["step"]), cfg.trainer.total_training_steps, rows[-1])


def status_url(cfg: RlbusConfig) -> str | None:
    """Where the run's NATS is: `bus.url`, else 127.0.0.1:4222 when a JetStream server answers there."""
    from rlbus.bus.local_server import DEFAULT_URL, jetstream_server_at

    if cfg.bus.url:
        return cfg.bus.url
    return DEFAULT_URL if jetstream_server_at("127.0.0.1", 4222) else None


async def _status(cfg: RlbusConfig, url: str, watch: bool) -> int:
    from rlbus.bus import Bus, BusConnectError, connect, redact_url

    try:
        nc = await connect(cfg.bus, url, "rlbus-status", wait_s=CONNECT_WAIT_S)
    except BusConnectError as exc:
        print(f"rlbus status: {exc}", file=sys.stderr)
        return 1
    bus = Bus(nc, cfg.run.id, cfg.bus)
    stop = asyncio.Event()
    if watch:  # Ctrl-C ends the watch between redraws, promptly, whatever the bus is doing
        import signal

        asyncio.get_running_loop().add_signal_handler(signal.SIGINT, stop.set)
    try:
        while not stop.is_set():
            try:
                snapshot = await collect_status(bus)
            except RunNotFound as exc:
                print(f"rlbus status: {exc} (bus {redact_url(url)})", file=sys.stderr)
                if not watch:
                    return 1
            except Exception as exc:  # the server went away: once, that is the answer; watching, wait for it
                if not watch:
                    raise
                print(
                    f"rlbus status: bus {redact_url(url)} unreachable ({type(exc).__name__}: {exc}); "
                    "retrying",
                    file=sys.stderr,
                    flush=True,
                )
            else:
                snapshot["progress"] = _progress(cfg)
                text = render_status(snapshot)
                if watch and sys.stdout.isatty():
                    text = "\x1b[H\x1b[2J" + text  # redraw in place
                print(text, end="" if not watch else "\n", flush=True)
            if not watch:
                return 0
            try:
                await asyncio.wait_for(stop.wait(), timeout=WATCH_EVERY_S)
            except TimeoutError:
                pass
        return 0
    finally:
        try:
            await asyncio.wait_for(bus.close(), timeout=5.0)
        except TimeoutError:
            pass


def as_reader(cfg: RlbusConfig) -> RlbusConfig:
    """A run `rlbus up` started with its own server has a read-only user for status: connect as it, unless
    credentials were given."""
    from rlbus.bus.roles import read_reader

    bus = cfg.bus
    if bus.user or bus.token or bus.creds_file or bus.nkeys_seed:
        return cfg
    reader = read_reader(Path(cfg.run.dir) / cfg.run.id / "nats")
    if reader is None:
        return cfg
    out = cfg.model_copy(deep=True)
    out.bus.user, out.bus.password = reader
    return out


def run_status(cfg: RlbusConfig, watch: bool = False) -> int:
    """Print the run's status table (again every 2 s with `watch`, until Ctrl-C). 1 when no server answers."""
    from rlbus.bus import redact_url
    from rlbus.logs import setup_logging

    setup_logging("critical", service=None)  # bus chatter (reconnects) must not mix into the table
    cfg = as_reader(cfg)
    url = status_url(cfg)
    if url is None:
        print(
            "rlbus status: no NATS server answers at nats://127.0.0.1:4222 and bus.url is not set; "
            "pass --config <run_dir>/config.yaml or bus.url=nats://host:4222",
            file=sys.stderr,
        )
        return 1
    try:
        return asyncio.run(_status(cfg, url, watch))
    except KeyboardInterrupt:
        return 0
    except Exception as exc:  # a server that goes away mid-read: say so, no traceback
        print(
            f"rlbus status: cannot read run {cfg.run.id!r} from {redact_url(url)}: {type(exc).__name__}: {exc}",
            file=sys.stderr,
        )
        return 1


__all__ = ["RunNotFound", "collect_status", "render_status", "run_status", "status_url"]
