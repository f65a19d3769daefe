"""CUDA IPC weight handoff on a real GPU (make test-gpu): learner and replica are two processes on one GPU."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

PROMPT = [5, 6, 7, 8, 9, 10]
RESPONSE = [11, 12, 13, 14, 15]


def _announcement(handle: dict, metas, checksum: float, version: int):
    from rlbus.messages import IpcBuffer, WeightAnnouncement

    return WeightAnnouncement(
        run_id="gpu-test",
        version=version,
        epoch=1,
        master_addr="127.0.0.1",
        master_port=0,
        world_size=1,
        ranks={},
        names=[m.name for m in metas],
        dtypes=[m.dtype for m in metas],
        shapes=[list(m.shape) for m in metas],
        buckets=[list(range(len(metas)))],
        checksum=checksum,
        ipc_replicas=["replica"],
        ipc_buffer=IpcBuffer(**handle),
    )


def _replica(model_dir: str, inbox, outbox) -> None:
    """The replica process: the embedded engine on the same GPU, fed only announcements."""
    from rlbus.rollout.engines.hf import HFEngine
    from rlbus.weight_sync import weights_checksum

    engine = HFEngine(model_dir, dtype="float32", device="cuda", compiled_decode=False)
    try:
        while (ann := inbox.get()) is not None:
            try:
                received = engine.take_ipc_weights(ann)
                engine.load_received(received, ann.version)
                state = engine.model.state_dict()
                required, _ = engine.expected_weight_names()
                outbox.put(
                    (
                        ann.version,
                        weights_checksum(state[n] for n in sorted(required)),
                        engine.score(PROMPT, RESPONSE).tolist(),
                    )
                )
            except Exception as exc:  # noqa: BLE001 - reported to the test
                outbox.put(("error", repr(exc), None))
    finally:
        engine.close()


def _learner_logprobs(model) -> list[float]:
    from rlbus.modeling import response_logprobs

    return response_logprobs(model, [PROMPT], [RESPONSE], 0, 1.0)[0].tolist()


def test_ipc_handoff_checksum_and_logprobs_match(tmp_path: Path) -> None:
    from helpers_tiny import build_tiny_model, perturbed_model

    from rlbus.weight_ipc import IpcWeightSender
    from rlbus.weight_sync import weights_checksum

    model_dir = build_tiny_model(tmp_path / "tiny")
    ctx = mp.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    replica = ctx.Process(target=_replica, args=(str(model_dir), inbox, outbox), daemon=True)
    replica.start()
    sender = IpcWeightSender("cuda")  # one buffer, refilled per version
    try:
        for version, seed in ((1, 11), (2, 22)):
            model = perturbed_model(model_dir, seed).cuda()
            named = list(model.named_parameters())
            metas, checksum = sender.fill(named)
            assert checksum == pytest.approx(weights_checksum(t for _, t in named), rel=1e-9)
            inbox.put(_announcement(sender.handle, metas, checksum, version))
            got_version, got_checksum, got_lp = outbox.get(timeout=120)
            assert got_version == version, got_checksum
            assert got_checksum == pytest.approx(checksum, rel=1e-9)
            torch.testing.assert_close(
                torch.tensor(got_lp), torch.tensor(_learner_logprobs(model.eval())), rtol=0, atol=1e-5
            )
        # A learner restart shares a new buffer: the replica maps it by its new id.
        restarted = IpcWeightSender("cuda")
        model = perturbed_model(model_dir, 33).cuda()
        metas, checksum = restarted.fill(list(model.named_parameters()))
        assert restarted.handle["buffer_id"] != sender.handle["buffer_id"]
        inbox.put(_announcement(restarted.handle, metas, checksum, 3))
        got_version, got_checksum, got_lp = outbox.get(timeout=120)
        assert got_version == 3, got_checksum
        torch.testing.assert_close(
            torch.tensor(got_lp), torch.tensor(_learner_logprobs(model.eval())), rtol=0, atol=1e-5
        )
    finally:
        inbox.put(None)
        replica.join(60)
        if replica.is_alive():
            replica.kill()


def test_ipc_refill_while_reading_is_caught_by_the_checksum(tmp_path: Path) -> None:
    """The announcement's checksum is of version N; a buffer already holding N+1 is refused, never loaded."""
    from helpers_tiny import build_tiny_model, perturbed_model

    from rlbus.weight_ipc import IpcWeightSender

    model_dir = build_tiny_model(tmp_path / "tiny")
    sender = IpcWeightSender("cuda")
    metas, checksum_1 = sender.fill(list(perturbed_model(model_dir, 1).cuda().named_parameters()))
    sender.fill(list(perturbed_model(model_dir, 2).cuda().named_parameters()))
    ctx = mp.get_context("spawn")  # CUDA IPC maps memory of another process only
    inbox, outbox = ctx.Queue(), ctx.Queue()
    replica = ctx.Process(target=_replica, args=(str(model_dir), inbox, outbox), daemon=True)
    replica.start()
    try:
        inbox.put(_announcement(sender.handle, metas, checksum_1, 1))
        status, detail, _ = outbox.get(timeout=120)
        assert status == "error"
        assert "checksum mismatch" in detail
    finally:
        inbox.put(None)
        replica.join(60)
        if replica.is_alive():
            replica.kill()
