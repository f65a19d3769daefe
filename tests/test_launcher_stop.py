"""`rlbus up`'s stop signals every service before it waits for any (`stop_all`)."""

from __future__ import annotations

import sys
from pathlib import Path

from e2e_utils import wait_until

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
