"""`rlbus up`'s stop signals every service before it waits for any (`stop_all`)."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

from e2e_utils import up_command, wait_until

from rlbus.launcher import ServiceProcess, stop_all

# A service that, once asked to stop, waits up to 10 s for its neighbour to be asked too, then says which came
# first. Stopped one after another, the first would wait its 10 s alone.
SLOW_TO_STOP = """
import pathlib, signal, sys, time
me, other = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
def on_term(*_):
    (me.parent / (me.name + ".asked")).touch()
    deadline = time.monotonic() + 10
    while not (other.parent / (other.name + ".asked")).exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    me.write_text("stopped beside the other" if time.monotonic() < deadline else "stopped alone")
    sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
(me.parent / (me.name + ".ready")).touch()
while True:
    signal.pause()
"""


def test_every_service_is_asked_to_stop_before_the_run_waits_for_any(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    procs = [
        ServiceProcess(
            name,
            "reward",
            [str(me), str(other)],
            tmp_path / f"{name}.log",
            command=[sys.executable, "-c", SLOW_TO_STOP],
        )  # fmt: skip
        for name, me, other in (("a", a, b), ("b", b, a))
    ]
    for p in procs:
        p.start()
    wait_until(lambda: all((tmp_path / f"{n}.ready").exists() for n in "ab"), 30, "both services ready")
    stop_all(procs, timeout=30)
    assert [p.proc.returncode for p in procs if p.proc is not None] == [0, 0]
    assert a.read_text() == b.read_text() == "stopped beside the other"


def test_ctrl_c_stops_the_run_and_says_so_not_as_a_failure(
    tmp_path: Path, nats_url: str, run_id: str
) -> None:
    """Ctrl-C while the services start: every one stops (the learner mid-setup too), `rlbus up` exits 130 and
    its last line says it stopped, where it used to read as a failure ("learner exited with 130")."""
    up = subprocess.Popen(
        up_command(tmp_path, nats_url, run_id), cwd=tmp_path, stderr=subprocess.PIPE, text=True
    )
    learner_log = tmp_path / "runs" / run_id / "logs" / "learner.log"
    try:
        wait_until(
            lambda: learner_log.exists() and "service started" in learner_log.read_text(), 120, "the learner"
        )
        up.send_signal(signal.SIGINT)
        _, err = up.communicate(timeout=60)
    finally:
        up.kill()
    assert up.returncode == 130, err[-2000:]
    assert err.strip().splitlines()[-1] == f"rlbus: stopped; logs in {learner_log.parent}", err[-2000:]
    assert "rlbus: learner exited with" not in err
