"""rlbus.weight_sync over real gloo groups: separate OS processes (spawn) for the push scenarios, threads of
one process for the cheaper protocol corner cases, and plain unit tests for buckets and checksums."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from rlbus.weight_sync import (
    ALIGN,
    TensorMeta,
    WeightReceiver,
    WeightSender,
    WeightSyncError,
    bucket_layout,
    checksums_match,
    describe_tensors,
    dtype_from_str,
    flatten_bucket,
    free_port,
    metas_from_lists,
    plan_buckets,
    seal_bucket,
    unflatten_bucket,
    unseal_bucket,
    weights_checksum,
)

HOST = "127.0.0.1"
BUCKET_BYTES = 16 * 1024
RDV_S = 30.0  # spawned children import torch on shared cores: joining can take seconds


def make_state(version: int) -> dict[str, torch.Tensor]:
    """A small model's state dict, deterministic per version: fp32, bf16, int64, bool, a 0-dim tensor, an
    empty one, and `big` (32 KiB) that is larger than a bucket."""
    g = torch.Generator().manual_seed(1000 + version)
    return {
        "embed.weight": torch.randn(50, 16, generator=g).to(torch.bfloat16),
        "layers.0.attn.qkv.weight": torch.randn(48, 16, generator=g),
        "layers.0.attn.qkv.bias": torch.randn(48, generator=g).to(torch.bfloat16),
        "big": torch.randn(64, 128, generator=g),
        "layers.0.norm.weight": torch.ones(16) + version,
        "layers.0.mask": torch.rand(7, generator=g) > 0.5,
        "step": torch.tensor(version, dtype=torch.int64),
        "scale": torch.tensor(0.5 * version),
        "empty": torch.zeros(0, 3),
        "lm_head.weight": torch.randn(50, 16, generator=g).to(torch.bfloat16),
    }


def bit_exact(expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> str:
    """'' if equal in names, dtypes, shapes and raw bytes; else what differs."""
    if list(expected) != list(got):
        return f"names differ: {sorted(set(expected) ^ set(got))}"
    for name, e in expected.items():
        g = got[name]
        if g.dtype != e.dtype or g.shape != e.shape:
            return f"{name}: {g.dtype}{tuple(g.shape)} != {e.dtype}{tuple(e.shape)}"
        if e.numel() and not torch.equal(e.reshape(-1).view(torch.uint8), g.reshape(-1).view(torch.uint8)):
            return f"{name}: bytes differ"
    return ""


# --------------------------------------------------------------------------------------- child process


def receiver_main(name: str, inbox: Any, results: Any, device: str | None = None) -> None:
    """A replica: waits for announcements on `inbox` (stands in for NATS), joins, receives, reports.
    `device` (e.g. cuda:1) is where it keeps what it receives; the announcement names the backend."""
    torch.set_num_threads(1)
    receiver = WeightReceiver(device)
    try:
        while True:
            try:
                ann = inbox.get(timeout=45)
            except queue.Empty:
                return
            if ann is None:
                return
            t0 = time.monotonic()
            try:
                receiver.connect(
                    HOST,
                    ann["port"],
                    ann["rank"],
                    ann["world_size"],
                    epoch=ann["epoch"],
                    timeout_s=ann["timeout_s"],
                    rendezvous_timeout_s=RDV_S,
                    backend=ann.get("backend", "gloo"),
                )
                if ann.get("stall"):  # joined but never takes part in the push
                    results.put((name, ann["version"], "stalled", ""))
                    time.sleep(ann["stall"])
                    continue
                metas = metas_from_lists(ann["names"], ann["dtypes"], ann["shapes"])
                if ann.get("die_after_bucket") is not None:
                    for k, _ in enumerate(receiver.iter_receive(metas, ann["buckets"], ann["checksum"])):
                        if k == ann["die_after_bucket"]:
                            os.kill(os.getpid(), signal.SIGKILL)
                got = {
                    k: v.cpu() for k, v in receiver.receive(metas, ann["buckets"], ann["checksum"]).items()
                }
                diff = bit_exact(make_state(ann["version"]), got)
                results.put((name, ann["version"], "ok" if not diff else "wrong", diff))
            except WeightSyncError as exc:
                results.put((name, ann["version"], "error", f"{exc} after {time.monotonic() - t0:.1f}s"))
    finally:
        receiver.close()


class Replicas:
    """Spawned receiver processes with one inbox each and a shared results queue; always cleaned up."""

    def __init__(self, names: list[str], device: str | None = None) -> None:
        ctx = mp.get_context("spawn")
        self.results = ctx.Queue()
        self.inboxes = {n: ctx.Queue() for n in names}
        self.procs = {
            n: ctx.Process(target=receiver_main, args=(n, self.inboxes[n], self.results, device), daemon=True)
            for n in names
        }
        for p in self.procs.values():
            p.start()

    def announce(
        self,
        sender: WeightSender,
        plan: Any,
        version: int,
        epoch: int,
        port: int,
        ranks: dict[str, int],
        **extra: Any,
    ) -> None:
        for name, rank in ranks.items():
            self.inboxes[name].put(
                {
                    "version": version,
                    "epoch": epoch,
                    "port": port,
                    "rank": rank,
                    "world_size": len(ranks) + 1,
                    "timeout_s": sender.timeout_s,
                    **plan.announcement_fields(),
                    **extra.get(name, {}),
                }
            )

    def collect(self, n: int, timeout: float = 40.0) -> dict[tuple[str, int], tuple[str, str]]:
        out = {}
        for _ in range(n):
            name, version, status, detail = self.results.get(timeout=timeout)
            out[(name, version)] = (status, detail)
        return out

    def close(self) -> None:
        for inbox in self.inboxes.values():
            inbox.put(None)
        for p in self.procs.values():
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(5)


def push(
    sender: WeightSender,
    replicas: Replicas,
    version: int,
    epoch: int,
    ranks: dict[str, int],
    new_group: bool,
    **extra: Any,
) -> None:
    """What the learner does: plan, (host a new epoch's store), announce, (form the group), send lazily one
    tensor at a time."""
    plan = sender.plan(make_state(version).items())
    port = free_port(HOST) if new_group or sender.group is None else sender.group.master_port
    if new_group:
        sender.listen(port, len(ranks) + 1)
    replicas.announce(sender, plan, version, epoch, port, ranks, **extra)
    if new_group:
        sender.open(port, len(ranks) + 1, epoch)
    sender.send(iter(make_state(version).items()), plan)


# --------------------------------------------------------------------------------------- process tests


@pytest.mark.timeout(90)
def test_push_versions_and_membership_change_across_processes() -> None:
    """(a) 1 sender + 2 receivers bit-exact, (b) a second version on the same group, (c) epoch 2 with a
    smaller world on a new port."""
    torch.set_num_threads(1)
    replicas = Replicas(["a", "b"])
    sender = WeightSender("gloo", HOST, timeout_s=20.0, bucket_bytes=BUCKET_BYTES, rendezvous_timeout_s=RDV_S)
    try:
        plan = sender.plan(make_state(1).items())
        assert len(plan.buckets) >= 3 and any(len(b) == 1 and plan.names[b[0]] == "big" for b in plan.buckets)

        push(sender, replicas, 1, epoch=1, ranks={"a": 1, "b": 2}, new_group=True)
        assert sender.last_send_bytes == plan.total_bytes > 0 and sender.last_send_seconds > 0
        port1 = sender.group.master_port
        push(sender, replicas, 2, epoch=1, ranks={"a": 1, "b": 2}, new_group=False)
        assert sender.group.master_port == port1 and sender.epoch == 1
        got = replicas.collect(4)
        assert got == {(n, v): ("ok", "") for n in "ab" for v in (1, 2)}

        push(sender, replicas, 3, epoch=2, ranks={"b": 1}, new_group=True)
        assert sender.epoch == 2 and sender.group.world_size == 2 and sender.group.master_port != port1
        assert replicas.collect(1) == {("b", 3): ("ok", "")}
    finally:
        sender.close()
        replicas.close()


@pytest.mark.timeout(90)
def test_dead_or_stalled_receiver_raises_within_timeout_and_next_epoch_works() -> None:
    """(d) a receiver SIGKILLs itself mid-push: send raises within the timeout, the survivor's receive fails
    too (not garbage), and epoch 2 with the survivor alone works; then a receiver that joins but never takes
    part makes send raise after ~timeout_s rather than hang."""
    torch.set_num_threads(1)
    timeout_s = 4.0
    replicas = Replicas(["a", "b"])
    sender = WeightSender("gloo", HOST, timeout_s=timeout_s, bucket_bytes=4096, rendezvous_timeout_s=RDV_S)
    try:
        with pytest.raises(WeightSyncError):
            push(
                sender,
                replicas,
                1,
                epoch=1,
                ranks={"a": 1, "b": 2},
                new_group=True,
                b={"die_after_bucket": 1},
            )
        assert not sender.is_open
        assert sender.last_send_seconds < timeout_s + 1
        status, detail = replicas.collect(1)[("a", 1)]
        assert status == "error", detail
        replicas.procs["b"].join(10)
        assert replicas.procs["b"].exitcode == -signal.SIGKILL

        push(sender, replicas, 2, epoch=2, ranks={"a": 1}, new_group=True)
        assert replicas.collect(1) == {("a", 2): ("ok", "")}

        # Same group, but the replica joins the push late (stalls past the timeout): no hang either.
        plan = sender.plan(make_state(3).items())
        replicas.announce(sender, plan, 3, 2, sender.group.master_port, {"a": 1}, a={"stall": timeout_s + 1})
        assert replicas.collect(1)[("a", 3)][0] == "stalled"
        t0 = time.monotonic()
        with pytest.raises(WeightSyncError, match="failed after"):
            sender.send(make_state(3).items(), plan)
        assert timeout_s - 0.5 < time.monotonic() - t0 < timeout_s + 3
        assert not sender.is_open
    finally:
        sender.close()
        replicas.close()


# --------------------------------------------------------------------------------------- in-process groups


def in_thread(fn: Any) -> tuple[threading.Thread, dict[str, Any]]:
    """Run a receiver-side function in a thread (gloo ranks may share a process); result or error in box."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001
            box["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, box


def open_pair(timeout_s: float = 10.0) -> tuple[WeightSender, WeightReceiver]:
    sender = WeightSender("gloo", HOST, timeout_s=timeout_s, bucket_bytes=BUCKET_BYTES)
    receiver = WeightReceiver()
    port = free_port(HOST)
    thread, box = in_thread(lambda: receiver.connect(HOST, port, 1, 2, epoch=7, timeout_s=timeout_s))
    sender.open(port, 2, epoch=7)
    thread.join(10)
    assert "error" not in box, box
    assert receiver.is_connected and receiver.epoch == 7 and sender.is_open
    return sender, receiver


def transfer(
    sender: WeightSender, receiver: WeightReceiver, plan: Any, tensors: Any, checksum: float | None = None
) -> dict[str, Any]:
    thread, box = in_thread(lambda: receiver.receive(plan.metas, plan.buckets, checksum))
    try:
        sender.send(tensors, plan)
    except WeightSyncError as exc:
        box["send_error"] = exc
    thread.join(15)
    assert not thread.is_alive()
    return box


@pytest.mark.timeout(30)
def test_protocol_errors_abort_cleanly_and_the_group_stays_usable() -> None:
    """Failures on either side end the push with WeightSyncError on both and leave the group in step."""
    sender, receiver = open_pair()
    try:
        state = make_state(1)
        plan = sender.plan(state.items())

        def failing() -> Iterator[tuple[str, torch.Tensor]]:  # the learner's gather dies mid-way
            for i, item in enumerate(state.items()):
                if i == 5:
                    raise RuntimeError("gather failed")
                yield item

        box = transfer(sender, receiver, plan, failing())
        assert "aborted" in str(box["send_error"]) and "aborted" in str(box["error"])

        wrong = dict(state, big=state["big"].to(torch.bfloat16))  # a dtype that is not the announced one
        box = transfer(sender, receiver, plan, wrong.items())
        assert "does not match the plan" in str(box["send_error"]) and isinstance(
            box["error"], WeightSyncError
        )

        short = list(state.items())[:-1]
        box = transfer(sender, receiver, plan, short)
        assert "ran out" in str(box["send_error"]) and isinstance(box["error"], WeightSyncError)

        changed = {k: v.clone() for k, v in state.items()}  # stepped between plan() and send()
        changed["big"] += 1
        box = transfer(sender, receiver, plan, changed.items())
        assert "changed" in str(box["send_error"]) and "changed" in str(box["error"])

        # A replica holding a stale announcement (other checksum) refuses and drains the push.
        box = transfer(sender, receiver, plan, state.items(), checksum=plan.checksum + 1.0)
        assert "stale" in str(box["error"]) and "send_error" not in box

        # A layerwise loader that stops after one bucket: the rest is drained, nothing hangs.
        def first_bucket() -> list[tuple[str, torch.Tensor]]:
            gen = receiver.iter_receive(plan.metas, plan.buckets, plan.checksum)
            first = next(gen)
            gen.close()
            return first

        thread, box = in_thread(first_bucket)
        sender.send(state.items(), plan)
        thread.join(15)
        assert [n for n, _ in box["value"]] == [plan.names[i] for i in plan.buckets[0]]

        assert sender.is_open and receiver.is_connected
        box = transfer(sender, receiver, plan, state.items(), checksum=plan.checksum)
        assert "send_error" not in box and bit_exact(state, box["value"]) == ""
        assert receiver.last_receive_bytes == sender.last_send_bytes == plan.total_bytes
    finally:
        sender.close()
        receiver.close()


@pytest.mark.timeout(30)
def test_plan_mismatch_breaks_the_group_without_hanging() -> None:
    """A receiver told about another architecture cannot even size the buffers: it leaves the group, the
    sender fails fast, and the receiver refuses that epoch until a new one is announced."""
    sender, receiver = open_pair()
    try:
        state = make_state(1)
        plan = sender.plan(state.items())
        other = sender.plan(list(state.items())[:-1])
        thread, box = in_thread(lambda: receiver.receive(other.metas, other.buckets))
        t0 = time.monotonic()
        with pytest.raises(WeightSyncError):
            sender.send(state.items(), plan)
        assert time.monotonic() - t0 < 5
        thread.join(10)
        assert "differs from the announcement" in str(box["error"])
        assert not sender.is_open and not receiver.is_connected
        with pytest.raises(WeightSyncError, match="broke"):
            receiver.connect(HOST, receiver.group.master_port, 1, 2, epoch=7, timeout_s=10.0)
    finally:
        sender.close()
        receiver.close()


@pytest.mark.timeout(30)
def test_rendezvous_timeouts_name_the_missing_peer_and_the_sender_is_reusable() -> None:
    sender = WeightSender("gloo", HOST, timeout_s=5.0, rendezvous_timeout_s=1.0)
    port = free_port(HOST)
    t0 = time.monotonic()
    with pytest.raises(WeightSyncError, match=rf"waiting for ranks \[1, 2\] at {HOST}:{port}.*world size 3"):
        sender.open(port, 3, epoch=1)
    assert time.monotonic() - t0 < 4 and not sender.is_open

    receiver = WeightReceiver()
    dead_port = free_port(HOST)
    t0 = time.monotonic()
    with pytest.raises(WeightSyncError, match=f"could not reach the weight store at {HOST}:{dead_port}"):
        receiver.connect(HOST, dead_port, 1, 2, timeout_s=5.0, rendezvous_timeout_s=1.0)
    assert time.monotonic() - t0 < 6

    # An epoch disagreement is reported as such instead of timing out.
    port = free_port(HOST)
    thread, box = in_thread(
        lambda: receiver.connect(HOST, port, 1, 2, epoch=1, timeout_s=5.0, rendezvous_timeout_s=3.0)
    )
    with pytest.raises(WeightSyncError):
        sender.open(port, 2, epoch=2)
    thread.join(10)
    assert "expected epoch:world 1:2, the master has 2:2" in str(box["error"])

    # After all that, the same sender opens fine.
    s2, r2 = open_pair()
    s2.close(), r2.close()
    sender, receiver = open_pair()
    try:
        plan = sender.plan(make_state(2).items())
        box = transfer(sender, receiver, plan, make_state(2).items(), plan.checksum)
        assert bit_exact(make_state(2), box["value"]) == ""
    finally:
        sender.close()
        receiver.close()


# --------------------------------------------------------------------------------------- unit tests


def test_plan_buckets_keeps_order_and_limits() -> None:
    metas = [TensorMeta(f"t{i}", "float32", [n]) for i, n in enumerate([10, 10, 300, 5, 5, 5, 1000, 0])]
    # aligned sizes: 48, 48, 1200, 32, 32, 32, 4000, 0
    assert plan_buckets(metas, 100) == [[0, 1], [2], [3, 4, 5], [6, 7]]
    assert plan_buckets(metas, 1 << 20) == [list(range(8))]
    assert plan_buckets(metas, 1) == [[0], [1], [2], [3], [4], [5], [6, 7]]
    assert plan_buckets([], 100) == []
    for bucket_bytes in (64, 100, 1300, 5000):
        buckets = plan_buckets(metas, bucket_bytes)
        assert [i for b in buckets for i in b] == list(range(len(metas)))
        for b in buckets:
            nonempty = [i for i in b if metas[i].nbytes]
            assert len(nonempty) <= 1 or bucket_layout([metas[i] for i in b])[1] <= bucket_bytes
    with pytest.raises(ValueError):
        plan_buckets(metas, 0)


def test_flatten_unflatten_round_trip_mixed_dtypes() -> None:
    state = make_state(3)
    state["transposed"] = torch.randn(5, 7).t()  # non-contiguous
    state["half"] = torch.randn(3, 3, dtype=torch.float16)
    state["f64"] = torch.randn(3, dtype=torch.float64)
    metas = describe_tensors(state.items())
    assert metas[0] == TensorMeta("embed.weight", "bfloat16", [50, 16])
    flat = flatten_bucket(list(state.values()))
    offsets, total = bucket_layout(metas)
    assert flat.dtype == torch.uint8 and flat.numel() == total and all(o % ALIGN == 0 for o in offsets)
    back = dict(zip(state, unflatten_bucket(flat, metas), strict=True))
    assert bit_exact(state, back) == ""
    copies = unflatten_bucket(flat, metas, copy=True)
    flat.zero_()
    assert bit_exact(state, dict(zip(state, copies, strict=True))) == ""
    assert dtype_from_str("torch.bfloat16") is torch.bfloat16
    with pytest.raises(WeightSyncError):
        dtype_from_str("nonsense")
    with pytest.raises(WeightSyncError):
        unflatten_bucket(flat[:-16], metas)


def test_corrupt_or_missing_bucket_data_is_detected() -> None:
    """(e) the per-bucket digest catches a flipped byte, a zeroed buffer (a no-op transport), a truncated or
    misordered bucket; the value checksum catches weights that are not the announced ones."""
    tensors = [torch.randn(64, 64).to(torch.bfloat16), torch.randn(100), torch.arange(7)]
    wire = flatten_bucket(tensors, extra_bytes=32)
    seal_bucket(wire, 3)
    assert torch.equal(unseal_bucket(wire.clone(), 3), wire[:-32])

    flipped = wire.clone()
    flipped[1234] ^= 0x10
    with pytest.raises(WeightSyncError, match="digest mismatch"):
        unseal_bucket(flipped, 3)
    with pytest.raises(WeightSyncError, match="no trailer magic"):
        unseal_bucket(torch.zeros_like(wire), 3)
    with pytest.raises(WeightSyncError, match="trailer says bucket 3"):
        unseal_bucket(wire, 4)
    with pytest.raises(WeightSyncError):
        unseal_bucket(torch.cat([wire[:-48], wire[-32:]]), 3)
    aborted = seal_bucket(wire.clone(), 3, abort=True)
    with pytest.raises(WeightSyncError, match="aborted"):
        unseal_bucket(aborted, 3)

    expected = weights_checksum(tensors)
    metas = describe_tensors(zip("abc", tensors, strict=True))
    good = unflatten_bucket(unseal_bucket(wire, 3), metas)
    assert checksums_match(expected, weights_checksum(good))
    stale = [t.clone() for t in good]
    stale[1][0] += 1e-3
    assert not checksums_match(expected, weights_checksum(stale))
    misread = unflatten_bucket(wire[:-32], [TensorMeta("a", "float16", [64, 64]), *metas[1:]])
    assert not checksums_match(expected, weights_checksum(misread))
    assert checksums_match(float("nan"), float("nan")) and not checksums_match(1.0, float("nan"))
