"""A 2-rank learner whose ranks do not share a filesystem (a pod per node, each with a volume of its own):
each rank writes a checkpoint of its own shard, complete in itself (rlbus.learner.checkpoint_layout), and a
restart resumes from the newest step every rank completed.

The two ranks are started as torchrun would start them on two nodes (RANK, WORLD_SIZE, LOCAL_RANK=0 each,
env:// rendezvous). Each runs in a mount namespace of its own where the checkpoint folder, the same path for
both as in k8s, is a different disk (a bind mount of its own folder): root only, as in CI. Real NATS,
rollout and reward services.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from e2e_utils import Run, make_config

from rlbus.learner.checkpoint import list_checkpoints
from rlbus.weight_sync import free_port

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root and unshare"),
]


def _learner_ranks(run: Run, ckpt: Path, disks: list[Path], steps: int, log: Path) -> list[int]:
    """Runs rank 0 and rank 1 of the learner to the end, each seeing its own disk at `ckpt`; exit codes."""
    port = free_port()
    procs = []
    with open(log, "a") as out:
        for rank, disk in enumerate(disks):
            env = {
                **os.environ,
                "RANK": str(rank),
                "WORLD_SIZE": "2",
                "LOCAL_RANK": "0",  # one rank per "node"
                "LOCAL_WORLD_SIZE": "1",
                "GROUP_RANK": str(rank),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "OMP_NUM_THREADS": "1",
                "PYTHONUNBUFFERED": "1",
                "RLBUS_TRAINER__DEFAULT_LOCAL_DIR": str(ckpt),
                "RLBUS_TRAINER__TOTAL_TRAINING_STEPS": str(steps),
            }
            # Its own view of the checkpoint folder: `disk` mounted over it, seen by this process alone.
            shell = 'mount --bind "$1" "$2" && shift 2 && exec "$@"'
            cmd = [
                "unshare",
                "--mount",
                "--propagation",
                "private",
                "sh",
                "-c",
                shell,
                "_",
                str(disk),
                str(ckpt),
            ]
            cmd += [sys.executable, "-m", "rlbus.learner.main", "--config", str(run.config_path)]
            procs.append(subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT))
        return [p.wait(timeout=400) for p in procs]


@pytest.mark.timeout(900)
def test_two_ranks_with_folders_of_their_own_resume_from_a_step_both_completed(
    nats_url: str, run_id: str, tmp_path: Path
) -> None:
    cfg = make_config(
        nats_url,
        run_id,
        tmp_path,
        [
            "trainer.async_level=0",
            "data.train_batch_size=4",
            "rollout.n=4",
            "trainer.test_freq=-1",
            "trainer.val_before_train=false",
            "trainer.device=cpu",
            "rollout.device=cpu",
            "actor.ppo_micro_batch_size=4",
            "trainer.save_freq=2",
            "trainer.max_ckpt_to_keep=2",
            "trainer.resume_mode=auto",
        ],
    )
    disks = [tmp_path / "node0-disk", tmp_path / "node1-disk"]
    ckpt = tmp_path / "checkpoints"  # the path both ranks are configured with
    for folder in (*disks, ckpt):
        folder.mkdir()
    run = Run(cfg)
    run.procs = [p for p in run.procs if p.name != "learner"]  # the learner's ranks are started below
    log = run.run_dir / "logs" / "learner-ranks.log"
    with run:
        assert _learner_ranks(run, ckpt, disks, steps=4, log=log) == [0, 0], log.read_text()[-4000:]
        for rank, disk in enumerate(disks):
            assert [s for s, _ in list_checkpoints(disk)] == [2, 4], rank
            step4 = disk / "global_step_4"
            meta = json.loads((step4 / "meta.json").read_text())
            assert meta["layout"] == "per_rank" and meta["world_size"] == 2
            assert (step4 / "state" / ".metadata").is_file()  # its own shard's metadata, not rank 0's
            assert (step4 / f"rng_rank{rank}.json").is_file()
            assert (step4 / "hf").is_dir() == (rank == 0)  # rank 0's files are on rank 0's disk only
        # Rank 1's node died before it sealed step 4: only step 2 is complete on both.
        (disks[1] / "global_step_4").rename(disks[1] / "global_step_4.tmp")
        assert _learner_ranks(run, ckpt, disks, steps=6, log=log) == [0, 0], log.read_text()[-4000:]
        rows = run.metrics()
    text = log.read_text()
    assert "resuming from an older checkpoint" in text
    assert "resumed from checkpoint" in text and "step=2" in text.split("resumed from checkpoint", 1)[1][:400]
    assert [r["step"] for r in rows if "actor/loss" in r] == [1, 2, 3, 4, 5, 6]  # steps 3-4 again, then on
    assert all(np.isfinite(r["actor/loss"]) for r in rows if "actor/loss" in r)
