"""The per-step memory checkpoint (rlbus.learner.memory_checkpoint): what a slot holds comes back exactly, a
slot is named resumable only once whole and the named one is never the next one overwritten, another
history's slots are never resumed, and a state that does not fit turns it off with the reason."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from rlbus.learner.memory_checkpoint import (
    TOKEN_FILE,
    MemoryCheckpoint,
    MemoryCheckpointer,
    find_memory_checkpoint,
    load_memory_checkpoint,
    read_record,
)
from rlbus.learner.memory_slots import PackedCopy, Slot, plan_chunks, plan_layout, tmpfs_room
from rlbus.learner.optim import MasterWeightAdamW
from rlbus.learner.step_checkpoints import memory_wanted, newest, other_runs_slots


class Log:
    def __init__(self) -> None:
        self.warnings: list[tuple[str, dict]] = []

    def warning(self, event: str, **kw: object) -> None:
        self.warnings.append((event, kw))


def make_trainer(seed: int, hidden: int = 16) -> SimpleNamespace:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 4)).to(
        torch.bfloat16
    )
    optimizer = MasterWeightAdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
    return SimpleNamespace(model=model, optimizer=optimizer, scheduler=scheduler)


def train_step(trainer: SimpleNamespace) -> None:
    x = torch.randn(5, 8, dtype=torch.bfloat16)
    trainer.model(x).float().pow(2).mean().backward()
    trainer.optimizer.step()
    trainer.optimizer.zero_grad()
    trainer.scheduler.step()


def optimizer_tensors(trainer: SimpleNamespace) -> list[torch.Tensor]:
    return [v for p in trainer.model.parameters() for v in trainer.optimizer.state[p].values()]


def test_a_resumed_trainer_holds_exactly_the_saved_step(tmp_path: Path) -> None:
    run_dir, slots = tmp_path / "run", tmp_path / "shm"
    trainer = make_trainer(0)
    saver = MemoryCheckpointer(slots, trainer, run_dir, Log())
    for step in range(1, 4):
        train_step(trainer)
        saver.after_step(step, lambda step=step: {"step": step, "loader": {"position": step * 4}})
    rng_at_save = torch.get_rng_state()
    found = find_memory_checkpoint(slots, run_dir)
    assert found is not None and found.step == 3  # a CPU copy is named resumable at once

    other = make_trainer(1)
    train_step(other)  # optimizer state exists, and differs
    extra = load_memory_checkpoint(found, other)
    assert extra == {"step": 3, "loader": {"position": 12}}
    for a, b in zip(trainer.model.parameters(), other.model.parameters(), strict=True):
        assert torch.equal(a, b)
    for a, b in zip(optimizer_tensors(trainer), optimizer_tensors(other), strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)  # the fp32 master weights stay fp32
    assert other.optimizer.param_groups[0]["lr"] == trainer.optimizer.param_groups[0]["lr"]
    assert other.scheduler.last_epoch == trainer.scheduler.last_epoch == 3
    train_step(trainer)  # draws from the RNG
    load_memory_checkpoint(found, other)
    assert torch.equal(torch.get_rng_state(), rng_at_save)  # the RNG states came back too
    saver.close(remove=True)
    assert not slots.exists()


def test_the_named_slot_is_never_the_next_one_written(tmp_path: Path) -> None:
    run_dir, slots = tmp_path / "run", tmp_path / "shm"
    trainer = make_trainer(0)
    saver = MemoryCheckpointer(slots, trainer, run_dir, Log())
    named = []
    for step in range(1, 5):
        train_step(trainer)
        saver.after_step(step, lambda step=step: {"step": step})
        named.append(read_record(slots)["slot"])
    assert named == [0, 1, 0, 1]
    saver.close(remove=False)
    # a new process of the same run (a restart) writes first into the slot the marker does not name
    again = MemoryCheckpointer(slots, trainer, run_dir, Log())
    train_step(trainer)
    again.after_step(5, lambda: {"step": 5})
    assert read_record(slots)["slot"] == 0


def test_slots_of_another_history_are_not_resumed(tmp_path: Path) -> None:
    run_dir, slots = tmp_path / "run", tmp_path / "shm"
    trainer = make_trainer(0)
    saver = MemoryCheckpointer(slots, trainer, run_dir, Log())
    train_step(trainer)
    saver.after_step(1, lambda: {"step": 1})
    assert find_memory_checkpoint(slots, run_dir) is not None
    (run_dir / TOKEN_FILE).unlink()  # the run dir was removed and made again: a new history
    assert find_memory_checkpoint(slots, run_dir) is None
    assert find_memory_checkpoint(tmp_path / "elsewhere", run_dir) is None


def test_tensors_are_packed_in_chunks_and_land_where_the_layout_says(tmp_path: Path) -> None:
    torch.manual_seed(0)
    tensors = [
        torch.randn(3, 5),  # 60 bytes
        torch.randn(7).to(torch.bfloat16),
        torch.arange(40, dtype=torch.int64),  # 320 bytes: larger than the chunk, copied on its own
        torch.randn(2, 2).double(),
        torch.tensor(3.0),
    ]
    entries, size = plan_layout([(f"t{i}", t) for i, t in enumerate(tensors)])
    groups = plan_chunks(entries, chunk=256)
    assert groups == [[0, 1], [2], [3, 4]]
    assert all(
        entries[g[-1]].offset + entries[g[-1]].nbytes - entries[g[0]].offset <= 256
        for g in groups
        if len(g) > 1
    )
    slot = Slot(tmp_path / "slot.bin", size, entries, pin=False)
    PackedCopy(entries, tensors, torch.device("cpu"), chunk=256).copy_into(slot)
    for entry, tensor in zip(entries, tensors, strict=True):
        assert torch.equal(slot.views[entry.key], tensor)
    assert (tmp_path / "slot.bin").stat().st_size == size and size % (2 << 20) == 0


def test_a_state_that_does_not_fit_turns_it_off_with_the_reason(tmp_path: Path) -> None:
    assert tmpfs_room(tmp_path, 10**18) is not None and "needs" in str(tmpfs_room(tmp_path, 10**18))
    assert tmpfs_room(tmp_path / "not" / "made", 1024) is None


@pytest.mark.gpu
def test_the_copy_on_a_gpu_waits_only_in_the_next_optimizer_step(tmp_path: Path) -> None:
    """The slot's copy and the rolling checkpoint's both read the step's weights before the next optimizer
    step changes them."""
    if not torch.cuda.is_available():
        pytest.skip("the side-stream copy needs a GPU (the CPU path copies in place, tested above)")
    trainer = make_trainer(0)
    trainer.model.cuda()
    trainer.optimizer = MasterWeightAdamW(trainer.model.parameters(), 1e-2, (0.9, 0.99), 1e-8, 0.0)
    trainer.scheduler = torch.optim.lr_scheduler.LambdaLR(trainer.optimizer, lambda s: 1.0)
    saver = MemoryCheckpointer(tmp_path / "shm", trainer, tmp_path / "run", Log())

    def step() -> None:
        x = torch.randn(5, 8, dtype=torch.bfloat16, device="cuda")
        trainer.model(x).float().pow(2).mean().backward()
        trainer.optimizer.step()
        trainer.optimizer.zero_grad()

    step()
    saver.after_step(1, lambda: {"step": 1})
    staging = saver.stage_for_disk(1)  # the rolling checkpoint's copy, behind the slot's on the side stream
    assert staging is not None and staging.ready is not None
    expected = [p.detach().cpu().clone() for p in trainer.model.parameters()]
    step()  # changes the weights only after both copies read them
    staging.ready.synchronize()
    for key, value in zip(("0.weight", "0.bias", "2.weight", "2.bias"), expected, strict=True):
        assert torch.equal(staging.state["model"][key], value)
    saver.after_step(2, lambda: {"step": 2})  # names step 1's slot
    found = find_memory_checkpoint(tmp_path / "shm", tmp_path / "run")
    assert found is not None and found.step == 1
    other = make_trainer(1)
    other.model.cuda()
    other.optimizer = MasterWeightAdamW(other.model.parameters(), 1e-2, (0.9, 0.99), 1e-8, 0.0)
    load_memory_checkpoint(found, other)
    for a, b in zip(expected, other.model.parameters(), strict=True):
        assert torch.equal(a, b.cpu())
    saver.close(remove=True)


def test_which_checkpoint_a_start_resumes(tmp_path: Path) -> None:
    disk = tmp_path / "global_step_6"
    memory = MemoryCheckpoint(tmp_path, 7, {})
    assert newest(disk, memory) is memory
    assert newest(disk, MemoryCheckpoint(tmp_path, 6, {})) == disk  # a tie: the disk one survives more
    assert newest(None, memory) is memory and newest(disk, None) == disk and newest(None, None) is None
    assert memory_wanted("auto", on_gpu=True, world=1) and not memory_wanted("auto", on_gpu=False, world=1)
    assert memory_wanted("on", on_gpu=False, world=1) and not memory_wanted("on", on_gpu=True, world=2)
    assert not memory_wanted("off", on_gpu=True, world=1)


def test_a_critic_comes_back_too_and_a_misfit_is_refused(tmp_path: Path) -> None:
    """PPO's value model and its optimizer are in the slot; a trainer of another shape, or a slot file gone,
    is a CheckpointError (the learner then resumes from its disk checkpoint)."""
    from rlbus.learner.checkpoint import CheckpointError

    run_dir, slots = tmp_path / "run", tmp_path / "shm"
    trainer = make_trainer(0)
    trainer.critic = make_trainer(5)
    saver = MemoryCheckpointer(slots, trainer, run_dir, Log())
    for step in (1, 2):
        train_step(trainer)
        train_step(trainer.critic)
        saver.after_step(step, lambda step=step: {"step": step})
    found = find_memory_checkpoint(slots, run_dir)
    assert found is not None and found.step == 2

    other = make_trainer(1)
    other.critic = make_trainer(2)
    train_step(other)
    train_step(other.critic)
    assert load_memory_checkpoint(found, other) == {"step": 2}
    for a, b in zip(trainer.critic.model.parameters(), other.critic.model.parameters(), strict=True):
        assert torch.equal(a, b)
    assert other.critic.scheduler.last_epoch == trainer.critic.scheduler.last_epoch

    wider = make_trainer(3, hidden=32)
    wider.critic = make_trainer(4)
    with pytest.raises(CheckpointError, match="does not fit"):
        load_memory_checkpoint(found, wider)
    (slots / f"slot{found.record['slot']}.bin").unlink()
    with pytest.raises(CheckpointError, match="missing"):
        load_memory_checkpoint(found, other)


def test_other_runs_slots_are_found_with_their_size(tmp_path: Path) -> None:
    own, other = tmp_path / "rlbus-a-1", tmp_path / "rlbus-b-2"
    for folder, size in ((own, 10), (other, 300)):
        folder.mkdir()
        (folder / "slot0.bin").write_bytes(b"x" * size)
    (tmp_path / "not-ours").mkdir()
    assert other_runs_slots(tmp_path, own) == {other: 300}


def test_a_start_resumes_the_newer_and_drops_slots_it_does_not_resume(tmp_path: Path) -> None:
    from rlbus.config.schema import RlbusConfig
    from rlbus.learner.step_checkpoints import memory_directory, resume_source

    run_dir = tmp_path / "run"
    cfg = RlbusConfig(
        run={"id": "r1"}, trainer={"memory_checkpoint_dir": str(tmp_path / "shm"), "resume_mode": "auto"}
    )
    slots = memory_directory(cfg, run_dir)
    trainer = make_trainer(0)
    saver = MemoryCheckpointer(slots, trainer, run_dir, Log())
    for step in (1, 2, 3, 4, 5):
        train_step(trainer)
        saver.after_step(step, lambda step=step: {"step": step})
    saver.close(remove=False)
    older, newer = tmp_path / "global_step_3", tmp_path / "global_step_6"
    picked = resume_source(cfg, run_dir, older)
    assert isinstance(picked, MemoryCheckpoint) and picked.step == 5 and slots.exists()
    assert resume_source(cfg, run_dir, newer) == newer
    assert not slots.exists()  # another lineage's steps from now on: never preferred later


def test_the_rolling_disk_checkpoint_is_staged_from_the_memory_copy(tmp_path: Path) -> None:
    """With both checkpoints on, the rolling one's state is the memory checkpointer's second copy of the step
    (on a GPU a side-stream copy, not staging on the step's thread): the checkpoint written holds that step,
    though the next step changed the live tensors while it was being written."""
    import asyncio
    import copy

    from rlbus.config.schema import RlbusConfig
    from rlbus.learner.checkpoint import checkpoint_root, checkpoint_step, latest_checkpoint, load_checkpoint
    from rlbus.learner.step_checkpoints import StepCheckpoints

    run_dir = tmp_path / "run"
    cfg = RlbusConfig(
        run={"id": "r1"},
        trainer={
            "memory_checkpoint": "on",
            "memory_checkpoint_dir": str(tmp_path / "shm"),
            "rolling_checkpoint_budget": 0.05,
        },
    )
    trainer = make_trainer(0)
    trainer.par = SimpleNamespace(world_size=1)
    checkpoints = StepCheckpoints(cfg, run_dir, trainer, lambda step: False, Log())
    assert checkpoints.memory is not None and checkpoints.rolling is not None
    train_step(trainer)
    saved = copy.deepcopy((list(trainer.model.parameters()), optimizer_tensors(trainer)))
    lr = trainer.optimizer.param_groups[0]["lr"]

    async def step_then_write() -> None:
        await checkpoints.after_step(1, 0.1, trainer, lambda: {"step": 1}, None, False)
        train_step(trainer)  # the live state moves on while the write is in flight
        await checkpoints.flush()

    asyncio.run(step_then_write())
    assert checkpoints.memory.disk_buffer is not None  # staged from the memory checkpointer's copy
    written = latest_checkpoint(checkpoint_root(run_dir, cfg.trainer.default_local_dir))
    assert written is not None and checkpoint_step(written) == 1

    other = make_trainer(1)
    train_step(other)
    assert load_checkpoint(written, other) == {"step": 1}
    for a, b in zip(saved[0], other.model.parameters(), strict=True):
        assert torch.equal(a, b)
    for a, b in zip(saved[1], optimizer_tensors(other), strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert other.optimizer.param_groups[0]["lr"] == lr and other.scheduler.last_epoch == 1
    asyncio.run(checkpoints.finish())
