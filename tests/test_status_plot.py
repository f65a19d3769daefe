"""`rlbus status` and `rlbus plot`: on a short real run (separate processes, real NATS), and their pure parts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from e2e_utils import Run, make_config

from rlbus.bus import Bus, Stage
from rlbus.messages import Heartbeat
from rlbus.plot import PlotError, plot_run
from rlbus.status import collect_status, render_status

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _rlbus(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run(
        [sys.executable, "-m", "rlbus.cli", *args], capture_output=True, text=True, timeout=timeout, env=env
    )


def _row(text: str, first: str) -> list[str]:
    """The table row whose first two columns start with `first` (e.g. 'rollout rollout-0')."""
    for line in text.splitlines():
        if " ".join(line.split()[:2]) == first or (line.split()[:1] == [first]):
            return line.split()
    raise AssertionError(f"no row {first!r} in:\n{text}")


def _assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, f"{path} is not a PNG"
    assert len(data) > 20_000, f"{path} is only {len(data)} bytes"
    import matplotlib.image

    img = matplotlib.image.imread(str(path))
    assert img.shape[0] >= 300 and img.shape[1] >= 500
    assert float(img[..., :3].std()) > 0.05, "the image is blank"


def _status_once_learner_and_rollout_reported(config_path: Path, deadline_s: float) -> str:
    """`rlbus status` output once the learner's heartbeat says ready and rollout-0's carries its first
    generation's stats.

    Stats ride on heartbeats every 2 s, so on a fast machine step 2 can land before the first heartbeat that
    follows the replica's first generation; status is right to show '-' until then.
    """
    deadline = time.monotonic() + deadline_s
    while True:
        out = _rlbus("status", "--config", str(config_path))
        assert out.returncode == 0, out.stderr
        rollout = _row(out.stdout, "rollout rollout-0")
        learner = _row(out.stdout, "learner learner")
        if ("-" not in rollout[7:9] and learner[2] == "ready") or time.monotonic() > deadline:
            return out.stdout
        time.sleep(1.0)


@pytest.mark.timeout(300)
def test_status_and_plot_on_a_real_run(nats_url: str, run_id: str, tmp_path: Path) -> None:
    # Long enough to be still running while status looks at it on a fast machine; stopped once checked.
    cfg = make_config(
        nats_url,
        run_id,
        tmp_path,
        [
            "trainer.total_training_steps=400",
            "data.train_batch_size=8",
            "rollout.n=4",
            "rollout.prompts_per_batch=4",
            "trainer.async_level=1",
            "trainer.val_before_train=true",
            "trainer.test_freq=0",
            "data.num_val_examples=16",
        ],
    )
    with Run(cfg) as run:
        run.wait_for_step(2, 180)
        text = _status_once_learner_and_rollout_reported(run.config_path, deadline_s=60)
        header = text.splitlines()[0]
        assert header.startswith(f"run {run_id}") and "learner policy version" in header
        version = int(header.split("learner policy version")[1].split()[0])
        assert version >= 2, header
        learner = _row(text, "learner learner")
        assert learner[2] == "ready" and learner[4] == "yes", learner
        rollout = _row(text, "rollout rollout-0")
        assert rollout[2] == "ready" and rollout[4] == "yes", rollout
        assert int(rollout[5]) <= version and int(rollout[6]) == version - int(rollout[5]), rollout
        assert float(rollout[7]) > 0 and float(rollout[8]) > 0, "rollout tokens/s and groups"
        reward = _row(text, "reward reward-0")
        assert reward[4] == "yes"
        for stage, consumer in (("prompts", "rollout"), ("trajectories", "reward"), ("ready", "learner")):
            row = _row(text, stage)
            assert row[1].isdigit() and row[4] == "0" and row[5] == consumer, row
        assert "NO SERVICES ALIVE" not in text
        assert "last step: step " in text

        # --watch redraws every 2 s until Ctrl-C, then exits 0.
        watch = subprocess.Popen(
            [sys.executable, "-m", "rlbus.cli", "status", "--config", str(run.config_path), "--watch"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        header = f"run {run_id}  |"
        drawn: list[str] = []
        while sum(header in line for line in drawn) < 2:  # two redraws seen (the test's timeout bounds it)
            line = watch.stdout.readline() if watch.stdout else ""
            assert line, f"status --watch stopped drawing: {''.join(drawn)}"
            drawn.append(line)
        watch.send_signal(signal.SIGINT)
        rest, w_err = watch.communicate(timeout=20)
        assert watch.returncode == 0, w_err
        assert "".join(drawn + [rest]).count(header) >= 2
        assert run.learner.alive, run.logs("learner")
    # Run.__exit__ stopped every service gracefully (SIGTERM): each removed its heartbeat on the way out.
    assert run.learner.proc is not None and run.learner.proc.returncode == 130, run.logs("learner")
    after = _rlbus("status", "--config", str(run.config_path))
    assert after.returncode == 0, after.stderr
    assert "NO SERVICES ALIVE" in after.stdout, after.stdout  # every service left cleanly

    plotted = _rlbus("plot", str(run.run_dir))
    assert plotted.returncode == 0, plotted.stderr
    png = Path(plotted.stdout.strip().splitlines()[-1])
    assert png == run.run_dir / "plots" / "curves.png"
    _assert_png(png)
    custom = plot_run(run.run_dir, tmp_path / "out" / "mine.png")
    assert custom == [tmp_path / "out" / "mine.png"]
    _assert_png(custom[0])


def test_status_says_so_when_no_server_answers(tmp_path: Path) -> None:
    t0 = time.monotonic()
    out = _rlbus("status", "bus.url=nats://127.0.0.1:1", f"run.dir={tmp_path}")
    assert out.returncode == 1
    assert "cannot connect to NATS at nats://127.0.0.1:1" in out.stderr
    assert time.monotonic() - t0 < 30
    assert not (tmp_path / "nats").exists(), "status must never start a server"


def test_status_of_an_unknown_run(nats_url: str, run_id: str) -> None:
    out = _rlbus("status", f"bus.url={nats_url}", f"run.id={run_id}")
    assert out.returncode == 1
    assert f"run {run_id!r} has no state" in out.stderr


async def test_collect_status_reads_heartbeats_versions_depths_and_dead_letters(
    bus: Bus, run_id: str
) -> None:
    from rlbus.bus.headers import DeadLetter  # noqa: F401 - the type dead_letters() returns

    state = await bus.state()
    await state.set_policy_version(7)
    now = time.time()
    for hb in (
        Heartbeat(
            run_id=run_id,
            service="learner",
            instance_id="learner",
            policy_version=7,
            time=now,
            status="ready",
        ),
        Heartbeat(
            run_id=run_id,
            service="rollout",
            instance_id="rollout-0",
            policy_version=6,
            time=now,
            status="ready",
            stats={"tokens_per_s": 123.4, "groups": 40.0, "weight_ranks": 1.0},
        ),
        Heartbeat(
            run_id=run_id,
            service="rollout",
            instance_id="rollout-9",
            policy_version=2,
            time=now - 300,
            status="ready",
        ),
    ):
        await state.heartbeat(hb)
    await bus.publish_raw(Stage.TRAJECTORIES, b"\xc1 not msgpack")
    consumer = await bus.consumer(Stage.TRAJECTORIES, "reward", ack_wait_s=5)
    assert await consumer.fetch(1, timeout=1) == []  # the junk is dead-lettered on the way
    snap = await collect_status(bus)
    json.dumps(snap)  # plain data
    assert snap["policy_version"] == 7
    by_id = {r["instance"]: r for r in snap["instances"]}
    assert set(by_id) == {"learner", "rollout-0", "rollout-9"}
    assert by_id["rollout-0"]["alive"] and not by_id["rollout-9"]["alive"]
    assert snap["stages"]["trajectories"]["dead_letters"] == 1 and snap["dead_letters_total"] == 1
    assert snap["stages"]["trajectories"]["consumers"] == ["reward"]
    text = render_status(snap)
    row = _row(text, "rollout rollout-0")
    assert row[5:9] == ["6", "1", "123", "40"], row
    assert "weight_ranks=1" in text
    assert _row(text, "rollout rollout-9")[4] == "NO"
    assert _row(text, "trajectories")[4] == "1"


def test_render_status_without_live_services() -> None:
    snap = {
        "run_id": "r1",
        "time": time.time(),
        "policy_version": 3,
        "alive_s": 10.0,
        "dead_letters_total": 0,
        "instances": [],
        "stages": {
            s.value: {"depth": 0, "pending": 0, "in_work": 0, "dead_letters": 0, "consumers": []}
            for s in Stage
        },
    }
    text = render_status(snap)
    assert "NO SERVICES ALIVE: no heartbeat in the last 10s" in text
    assert _row(text, "prompts")[1] == "0"
    stale = {
        **snap,
        "instances": [
            {
                "service": "learner",
                "instance": "learner",
                "status": "ready",
                "age_s": 99.0,
                "alive": False,
                "policy_version": 3,
                "host": "h",
                "stats": {},
            }
        ],
    }
    text = render_status(stale)
    assert "NO SERVICES ALIVE" in text and "1 stale instance(s)" in text
    assert _row(text, "learner learner")[3:5] == ["1.6m", "NO"]


def test_plot_errors_clearly_on_a_missing_or_empty_file(tmp_path: Path) -> None:
    with pytest.raises(PlotError, match="no metrics file"):
        plot_run(tmp_path)
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(PlotError, match="empty"):
        plot_run(tmp_path)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "other": 2}\n')
    with pytest.raises(PlotError, match="none of"):
        plot_run(tmp_path)
    out = _rlbus("plot", str(tmp_path / "nowhere"))
    assert (
        out.returncode == 1 and "rlbus plot: no metrics file" in out.stderr and "Traceback" not in out.stderr
    )


def test_plot_draws_kl_and_val_points_and_skips_a_torn_last_line(tmp_path: Path) -> None:
    rows = [
        {
            "step": s,
            "reward/mean": s / 10,
            "reward/accuracy": s / 20,
            "actor/kl": 0.01 * s,
            "response/length_mean": 3 + s,
            "perf/tokens_per_s": 100.0 + s,
        }
        for s in range(1, 11)
    ]
    rows.insert(0, {"step": 0, "val/accuracy": 0.4})
    rows.append({"step": 10, "val/accuracy": 0.6, "policy/version": 10.0})
    text = "\n".join(json.dumps(r) for r in rows) + '\n{"step": 11, "reward/me'
    (tmp_path / "metrics.jsonl").write_text(text)
    [png] = plot_run(tmp_path, tmp_path / "figs")
    assert png == tmp_path / "figs" / "curves.png"
    _assert_png(png)


def test_progress_line_leads_with_the_guides_fields() -> None:
    from rlbus.metrics_log import progress_line

    line = progress_line(
        3,
        150,
        {
            "actor/loss": -0.01234,
            "actor/approx_kl": 0.00042,
            "reward/mean": 0.5,
            "perf/samples_per_s": 85.25,
            "reward/accuracy": 0.5,
            "perf/tokens_per_s": 2345.0,
        },
    )
    assert line.startswith(
        "step 3/150 | Loss -0.0123 | PPO KL 0.0004 | Reward 0.500 | Throughput 85.2 samples/s | acc 0.500 |"
    )
    assert "val - |" in line and "tok/s 2345" in line


def test_metrics_tail_reads_appended_rows_once_and_follows_a_rewind(tmp_path: Path) -> None:
    from rlbus.metrics_log import METRICS_FILE, MetricsTail

    path = tmp_path / METRICS_FILE
    tail = MetricsTail(tmp_path)
    assert tail.new_rows() == []  # no file yet
    path.write_text("".join(json.dumps({"step": s}) + "\n" for s in (1, 2, 3)))
    assert [r["step"] for r in tail.new_rows()] == [1, 2, 3]
    with open(path, "a") as fh:
        fh.write(json.dumps({"step": 4}) + "\n" + '{"step": 5')  # row 5 still being written
    assert [r["step"] for r in tail.new_rows()] == [4]
    with open(path, "a") as fh:
        fh.write("}\n")
    assert [r["step"] for r in tail.new_rows()] == [5]
    assert tail.new_rows() == []
    path.write_text("".join(json.dumps({"step": s}) + "\n" for s in (1, 2)))  # a resume rewound to step 2
    assert tail.new_rows() == []
    with open(path, "a") as fh:
        fh.write(json.dumps({"step": 3, "again": True}) + "\n")
    assert tail.new_rows() == [{"step": 3, "again": True}]
    # rewind_metrics puts a new file in place; the resumed learner may append past our old offset before
    # we look again: its rows come once, the rows kept from before are not repeated, nothing half-read
    tmp = path.with_suffix(".tmp")
    rows = [{"step": 1}, {"step": 2}, {"step": 3, "resumed": "a long row that runs past the old offset"}]
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tmp.replace(path)
    assert path.stat().st_size > tail.offset
    assert tail.new_rows() == [rows[2]]
