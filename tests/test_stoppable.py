"""A service asked to stop during its start-up ends at once (`rlbus.stoppable`), rather than after its model
load or compile (20-44 s on a GPU, past `rlbus up`'s 15 s grace, then killed)."""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import subprocess
import threading
from pathlib import Path

import pytest
from e2e_utils import Run, make_config, wait_until

from rlbus.stoppable import StoppedDuringStart, on_own_thread, unfinished_start_work, unless_stopped


def test_a_stop_abandons_start_up_work_still_running_on_its_thread() -> None:
    release = threading.Event()
    started = threading.Event()

    def load() -> str:
        started.set()
        release.wait(30)
        return "loaded"

    async def scenario() -> None:
        stop = asyncio.Event()
        waiting = asyncio.ensure_future(unless_stopped(stop, on_own_thread(load)))
        await asyncio.to_thread(started.wait, 30)
        stop.set()
        with pytest.raises(StoppedDuringStart):
            await waiting

    asyncio.run(scenario())  # returns although `load` still runs: its thread is nobody's to join
    assert any(name.endswith("load") for name in unfinished_start_work())
    release.set()
    for thread in threading.enumerate():
        if thread.name.endswith("load"):
            thread.join(30)
    assert unfinished_start_work() == []


def test_start_up_work_that_finishes_first_gives_its_result_or_its_error() -> None:
    def fails() -> None:
        raise ValueError("no such model")

    async def scenario() -> None:
        stop = asyncio.Event()
        assert await unless_stopped(stop, on_own_thread(lambda: 41 + 1)) == 42
        with pytest.raises(ValueError, match="no such model"):
            await unless_stopped(stop, on_own_thread(fails))

    asyncio.run(scenario())


# model code (trust_remote_code) whose import lasts until the test ends: the learner's model load, on its own
# thread, waits in it
SLOW_MODEL_CODE = """
import pathlib, time
from transformers import Qwen2ForCausalLM
(pathlib.Path({here!r}) / "loading").touch()
while not (pathlib.Path({here!r}) / "release").exists():
    time.sleep(0.05)

class SlowQwen2(Qwen2ForCausalLM):
    pass
"""


@pytest.mark.parametrize(("service", "code"), [("learner", 130), ("rollout-0", 0)])
def test_a_service_stopped_while_it_loads_its_model_exits_at_once(
    tmp_path: Path, nats_url: str, run_id: str, service: str, code: int
) -> None:
    """The learner (setup, its trainer's model) and an embedded-engine replica (its engine's model): each
    ends with its usual stop code when stopped inside a model load that has not ended."""
    from rlbus.model_source import resolve_model_path

    model = tmp_path / "model"
    shutil.copytree(resolve_model_path(None, False), model)
    (model / "modeling_slow.py").write_text(SLOW_MODEL_CODE.format(here=str(tmp_path)))
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(
        json.dumps({**config, "auto_map": {"AutoModelForCausalLM": "modeling_slow.SlowQwen2"}})
    )
    run = Run(
        make_config(nats_url, run_id, tmp_path, [f"model.path={model}", "model.trust_remote_code=true"])
    )
    proc = run.proc(service)
    proc.env["HF_MODULES_CACHE"] = str(tmp_path / "hf-modules")
    proc.start()
    try:
        wait_until(lambda: (tmp_path / "loading").exists(), 120, f"the {service} to load its model code")
        assert proc.proc is not None
        proc.proc.send_signal(signal.SIGTERM)
        try:
            ended = proc.proc.wait(60)  # the load would last until `release`, which comes after this
        except subprocess.TimeoutExpired:
            pytest.fail(f"the {service} waited for its model load to end before it stopped")
        assert ended == code
        assert f"{service.split('-')[0]} stopped during start-up" in proc.log_path.read_text()
    finally:
        (tmp_path / "release").touch()
        proc.stop(timeout=10)
