"""`rlbus replay RUN_DIR`: a finished (or running) run's trajectory log (bus.trajectory_log) exported in
verl's rollout_data_dir schema, one file per step (`<step>.parquet`, or `<step>.jsonl` as verl writes it).

Only what the run's ledger says was trained counts: a learner restart trains a step again with new prompt ids,
and the groups of the attempt that died are in the log but not in the ledger's `trained`. Each trained
prompt's samples are written exactly once, in the step the ledger records.

The bus is the run's own when it is still up (config.yaml's bus.url); a run whose `rlbus up` started its own
server is read by starting that server again on its store (`<run dir>/nats`), on loopback only.
"""

from __future__ import annotations

import asyncio
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

from rlbus.bus import Bus, BusConnectError
from rlbus.bus.roles import read_reader
from rlbus.bus.run_server import start_run_server
from rlbus.bus.trajectory_log import read_trajectory_log
from rlbus.config import RlbusConfig, load_config
from rlbus.learner.dispatch import Ledger
from rlbus.learner.rollout_data import sample_records


class ReplayError(RuntimeError):
    """The run cannot be replayed (no config, no ledger, no log); the message says what is missing."""


def export_rows(logged: list[tuple[int, Any]], ledger: Ledger) -> dict[int, list[dict[str, Any]]]:
    """Step -> sample records of the groups the ledger says were trained, each prompt once, in data order.
    Pure: `logged` is (step, ReadyGroup) as read from the log."""
    chosen: dict[str, tuple[int, Any]] = {}
    for step, group in logged:
        pid = group.scored.trajectories.work.prompt_id
        trained_at = ledger.trained.get(pid)
        if trained_at is None or trained_at + 1 != step:
            continue  # a dead attempt's group, or one the ledger never counted
        chosen.setdefault(pid, (step, group))
    by_step: dict[int, list[Any]] = defaultdict(list)
    for step, group in chosen.values():
        by_step[step].append(group)
    return {
        step: sample_records(sorted(groups, key=lambda g: g.scored.trajectories.work.index), step)
        for step, groups in sorted(by_step.items())
    }


def write_rows(rows: dict[int, list[dict[str, Any]]], out: Path, fmt: str) -> list[Path]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for step, records in rows.items():
        path = out / f"{step}.{fmt}"
        if fmt == "jsonl":
            path.write_text("".join(json.dumps(r, ensure_ascii=False, default=str) + "\n" for r in records))
        else:
            pq.write_table(pa.Table.from_pylist(records), path)
        paths.append(path)
    return paths


async def _read_log(cfg: RlbusConfig, run_dir: Path) -> list[tuple[int, Any]]:
    reader = read_reader(run_dir / "nats")  # a live run on its own closed server: read as its reader
    live = cfg.bus.model_copy(update={"user": reader[0], "password": reader[1]} if reader else {})
    server = None
    try:
        try:
            if not cfg.bus.url:
                raise BusConnectError("the run names no bus")
            bus = await Bus.open(
                cfg.model_copy(update={"bus": live}), name="replay", ensure=False, wait_s=3.0
            )
        except BusConnectError:
            if not (run_dir / "nats").is_dir():
                raise ReplayError(
                    f"the run's bus ({cfg.bus.url}) does not answer and {run_dir}/nats holds no store"
                ) from None
            own = cfg.bus.model_copy(update={"url": None, "local_port": 0, "user": None, "password": None})
            url, server = start_run_server(own, run_dir)
            bus = await Bus.open(cfg.model_copy(update={"bus": own}), url=url, name="replay", ensure=False)
        try:
            return [item async for item in read_trajectory_log(bus)]
        except LookupError as exc:
            raise ReplayError(str(exc)) from exc
        finally:
            await bus.close()
    finally:
        if server is not None:
            server.stop()


def replay(run_dir: Path, out: Path, fmt: str = "parquet") -> tuple[list[Path], int]:
    """Export the run's trajectory log; returns the files written and the number of samples."""
    if not (run_dir / "config.yaml").is_file():
        raise ReplayError(f"{run_dir} has no config.yaml: not a run directory")
    if not (run_dir / "ledger.json").is_file():
        raise ReplayError(f"{run_dir} has no ledger.json: the learner never saved one")
    cfg = load_config(run_dir / "config.yaml", [])
    logged = asyncio.run(_read_log(cfg, run_dir))
    rows = export_rows(logged, Ledger.load(run_dir / "ledger.json"))
    return write_rows(rows, out, fmt), sum(len(r) for r in rows.values())
