"""The bus against a real NATS server: schemas over JetStream, dead letters, redelivery, big payloads."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import structlog
from nats.js import api as js_api
from nats.js.errors import ObjectNotFoundError

from rlbus import codec
from rlbus.bus import Bus, BusConnectError, LocalNatsServer, RunState, Stage, connect, redact_url
from rlbus.bus.disconnects import ConnectionLostError, unless_disconnected
from rlbus.bus.headers import CLAIM_HEADER, DELIVERED_HEADER, ORIGINAL_SUBJECT_HEADER, STAGE_HEADER
from rlbus.bus.subjects import STAGE_MESSAGE, RunNames
from rlbus.config.schema import RlbusConfig
from rlbus.messages import (
    ALL_MESSAGES,
    SCHEMA_VERSION,
    Heartbeat,
    JoinCall,
    JoinReply,
    Message,
    PromptWork,
    ReadyGroup,
    Sample,
    SamplingParams,
    ScoredGroup,
    TrajectoryGroup,
    WeightAck,
    WeightAnnouncement,
    decode,
    encode,
)

MiB = 1024 * 1024


# ---------------------------------------------------------------- message builders


def prompt(run_id: str, i: int = 0, **kw: object) -> PromptWork:
    fields: dict[str, object] = dict(
        run_id=run_id,
        prompt_id=f"p{i}",
        index=i,
        step=1,
        min_policy_version=0,
        prompt_ids=[1, 2, 3],
        prompt_text="1+2=",
        meta={"answer": "3"},
        n=2,
        sampling=SamplingParams(max_tokens=4, seed=7),
    )
    fields.update(kw)
    return PromptWork(**fields)  # type: ignore[arg-type]


def trajectories(run_id: str, logprob_len: int = 3, n_samples: int = 2, i: int = 0) -> TrajectoryGroup:
    rng = np.random.default_rng(i)
    samples = [
        Sample(
            response_ids=[5] * min(logprob_len, 8),
            logprobs=-rng.random(logprob_len, dtype=np.float32),
            text="3",
            finish_reason="stop",
        )
        for _ in range(n_samples)
    ]
    return TrajectoryGroup(
        work=prompt(run_id, i),
        samples=samples,
        policy_version=2,
        replica_id="r0",
        engine="hf",
        timings={"generate_s": 0.5},
    )


def scored(run_id: str) -> ScoredGroup:
    return ScoredGroup(
        trajectories=trajectories(run_id),
        rewards=[1.0, 0.0],
        correct=[True, False],
        reward_errors=[None, "no answer"],
        reward_impl="addition",
    )


def one_of_each(run_id: str) -> dict[type[Message], Message]:
    made: dict[type[Message], Message] = {
        PromptWork: prompt(run_id),
        TrajectoryGroup: trajectories(run_id),
        ScoredGroup: scored(run_id),
        ReadyGroup: ReadyGroup(
            scored=scored(run_id),
            ref_logprobs=[np.array([-0.1, -0.2, -0.3], np.float32), np.zeros(3, np.float32)],
        ),
        WeightAnnouncement: WeightAnnouncement(
            run_id=run_id,
            version=3,
            epoch=1,
            master_addr="127.0.0.1",
            master_port=29500,
            world_size=2,
            ranks={"learner": 0, "r0": 1},
            names=["w", "b"],
            dtypes=["float32", "float32"],
            shapes=[[2, 2], [2]],
            buckets=[[0, 1]],
            checksum=1.5,
        ),
        Heartbeat: Heartbeat(
            run_id=run_id,
            service="rollout",
            instance_id="r0",
            policy_version=3,
            time=time.time(),
            stats={"tok_s": 10.0},
            host="h",
        ),
        WeightAck: WeightAck(replica_id="r0", version=3, ok=True, detail="loaded"),
        JoinCall: JoinCall(run_id=run_id, call_id="c1"),
        JoinReply: JoinReply(call_id="c1", replica_id="r0", incarnation="abc"),
    }
    assert set(made) == set(ALL_MESSAGES), "a new message schema needs a sample here"
    return made


def assert_same(a: Message, b: Message) -> None:
    """Same kind and byte-identical re-encoding (pydantic == cannot compare numpy fields)."""
    assert type(a) is type(b)
    assert encode(a) == encode(b)


# ---------------------------------------------------------------- schemas


def test_every_schema_round_trips_through_the_codec(run_id: str) -> None:
    for cls, msg in one_of_each(run_id).items():
        back = decode(encode(msg), cls)
        assert_same(msg, back)
    ready = decode(encode(one_of_each(run_id)[ReadyGroup]), ReadyGroup)
    assert isinstance(ready, ReadyGroup) and ready.ref_logprobs is not None
    assert ready.ref_logprobs[0].dtype == np.float32
    np.testing.assert_array_equal(ready.ref_logprobs[0], np.array([-0.1, -0.2, -0.3], np.float32))


async def test_every_schema_round_trips_through_jetstream(bus: Bus, run_id: str) -> None:
    for cls, msg in one_of_each(run_id).items():
        stage = next((s for s, c in STAGE_MESSAGE.items() if c is cls), Stage.PROMPTS)
        durable = f"rt-{cls.kind}"
        consumer = await bus.consumer(stage, durable, expected=cls, ack_wait_s=5)
        await bus.publish(stage, msg)
        got = await consumer.fetch(1, timeout=5)
        assert len(got) == 1, cls.kind
        assert_same(msg, got[0].message)
        assert got[0].num_delivered == 1
        await got[0].ack()
        await consumer.close()
        assert await bus.delete_consumer(stage, durable)
        assert await bus.stream_depth(stage) == 0
    # The arrays themselves, not only their re-encoding:
    tg = trajectories(run_id)
    consumer = await bus.consumer(Stage.TRAJECTORIES, "traj")
    await bus.publish(Stage.TRAJECTORIES, tg)
    (d,) = await consumer.fetch(1, timeout=5)
    assert isinstance(d.message, TrajectoryGroup)
    np.testing.assert_array_equal(d.message.samples[1].logprobs, tg.samples[1].logprobs)
    await d.ack()


async def test_services_creating_the_run_streams_at_once_all_succeed(
    bus: Bus, nats_url: str, run_id: str
) -> None:
    """Every service creates the run's streams at start, each on its own connection, at the same moment: a
    create that meets another's in flight ("subjects overlap", err 10065) is tried again, not raised (a
    replica once crashed on it at start). The race is rare; this runs it 8 services wide, 5 times."""
    import nats

    from rlbus.bus.streams import ensure_work_streams

    clients = [await nats.connect(nats_url) for _ in range(8)]
    try:
        for attempt in range(5):
            names = RunNames(run_id) if attempt == 0 else RunNames(f"{run_id}x{attempt}")
            await asyncio.gather(
                *(ensure_work_streams(c.jetstream(), names, js_api.StorageType.FILE, 1) for c in clients)
            )
            info = await bus.js.stream_info(names.stream(Stage.READY))
            assert info.config.subjects == [f"rlbus.{names.run_id}.ready"]
            if attempt:
                for stage in Stage:
                    for stream in names.streams(stage):
                        await bus.js.delete_stream(stream)
                await bus.js.delete_stream(names.dlq_stream)
    finally:
        for c in clients:
            await c.close()


async def test_ensure_streams_is_idempotent_and_names_are_namespaced(bus: Bus, run_id: str) -> None:
    await bus.ensure_streams("file")
    await bus.ensure_streams("file")
    names = RunNames(run_id)
    info = await bus.js.stream_info(names.stream(Stage.READY))
    assert info.config.retention == "workqueue"
    assert info.config.subjects == [f"rlbus.{run_id}.ready"]
    assert info.config.max_msg_size == -1
    dlq = await bus.js.stream_info(names.dlq_stream)
    assert dlq.config.retention == "limits" and dlq.config.subjects == [f"rlbus.{run_id}.dlq.>"]
    assert names.blobs_bucket == f"rlbus_{run_id}_blobs" and names.state_bucket == f"rlbus_{run_id}_state"
    with pytest.raises(ValueError):
        RunNames("bad.run")

    await bus.publish(Stage.READY, ReadyGroup(scored=scored(run_id)))
    assert await bus.stream_depth(Stage.READY) == 1
    await bus.purge_run()
    assert await bus.stream_depth(Stage.READY) == 0


# ---------------------------------------------------------------- dead letters


async def test_corrupt_bytes_are_dead_lettered_and_consumer_goes_on(bus: Bus, run_id: str) -> None:
    consumer = await bus.consumer(Stage.PROMPTS, "rollout", ack_wait_s=5)
    junk = b"\xc1\xff not msgpack at all"
    await bus.publish_raw(Stage.PROMPTS, junk, headers={"X-Test": "junk"})
    good = prompt(run_id, 1)
    await bus.publish(Stage.PROMPTS, good)
    got = await consumer.fetch(1, timeout=5)
    assert [d.message.prompt_id for d in got] == ["p1"]  # type: ignore[attr-defined]
    await got[0].ack()
    assert consumer.dead_letters == 1
    (dl,) = await bus.dead_letters(Stage.PROMPTS)
    reason, headers, data = dl
    assert "msgpack" in reason
    assert data == junk
    assert headers[STAGE_HEADER] == "prompts"
    assert headers[ORIGINAL_SUBJECT_HEADER] == f"rlbus.{run_id}.prompts"
    assert headers[DELIVERED_HEADER] == "1"
    assert headers["X-Test"] == "junk"
    assert await bus.stream_depth(Stage.PROMPTS) == 0
    assert await bus.dead_letter_count(Stage.PROMPTS) == 1
    assert await bus.dead_letter_count(Stage.READY) == 0


async def test_wrong_version_kind_and_invalid_body_are_dead_lettered(bus: Bus, run_id: str) -> None:
    consumer = await bus.consumer(Stage.PROMPTS, "rollout", ack_wait_s=5)
    body = prompt(run_id).model_dump(mode="python")
    await bus.publish_raw(
        Stage.PROMPTS, codec.pack({"kind": "prompt_work", "v": SCHEMA_VERSION + 98, "body": body})
    )
    await bus.publish_raw(Stage.PROMPTS, encode(one_of_each(run_id)[Heartbeat]))
    await bus.publish_raw(
        Stage.PROMPTS, codec.pack({"kind": "prompt_work", "v": SCHEMA_VERSION, "body": {**body, "n": 0}})
    )
    await bus.publish_raw(Stage.PROMPTS, codec.pack([1, 2, 3]))
    await bus.publish(Stage.PROMPTS, prompt(run_id, 9))
    got = await consumer.fetch(5, timeout=5)
    assert [d.message.prompt_id for d in got] == ["p9"]  # type: ignore[attr-defined]
    await got[0].ack()
    reasons = [dl.reason for dl in await bus.dead_letters(Stage.PROMPTS)]
    assert len(reasons) == 4 and consumer.dead_letters == 4
    assert "schema version 99" in reasons[0]
    assert "expected prompt_work, got heartbeat" in reasons[1]
    assert "invalid prompt_work" in reasons[2]
    assert "envelope" in reasons[3]


async def test_max_deliver_is_dead_lettered_after_naks_and_after_timeouts(bus: Bus, run_id: str) -> None:
    consumer = await bus.consumer(Stage.SCORED, "ref", ack_wait_s=1, max_deliver=2)
    await bus.publish(Stage.SCORED, scored(run_id))
    (d1,) = await consumer.fetch(1, timeout=5)
    await d1.nak()
    (d2,) = await consumer.fetch(1, timeout=5)
    assert d2.num_delivered == 2
    await d2.nak()  # the last allowed delivery: parked instead of redelivered
    assert consumer.dead_letters == 1
    (dl,) = await bus.dead_letters(Stage.SCORED)
    assert "2 deliveries" in dl.reason

    # Never acked (a consumer that hangs): after max_deliver ack timeouts it is parked at fetch time.
    await bus.publish(Stage.SCORED, scored(run_id))
    (d,) = await consumer.fetch(1, timeout=5)
    (d,) = await consumer.fetch(1, timeout=5)  # redelivered after ack_wait=1 s
    assert d.num_delivered == 2
    assert await consumer.fetch(1, timeout=3) == []
    assert consumer.dead_letters == 2
    assert "not acked after 2 deliveries" in (await bus.dead_letters(Stage.SCORED))[1].reason
    assert await bus.stream_depth(Stage.SCORED) == 0


async def test_fetch_returns_empty_on_timeout(bus: Bus) -> None:
    consumer = await bus.consumer(Stage.READY, "learner")
    t0 = time.monotonic()
    assert await consumer.fetch(4, timeout=0.5) == []
    assert time.monotonic() - t0 < 3


# ---------------------------------------------------------------- redelivery


_WORKER = textwrap.dedent(
    """
    import asyncio, sys, time
    from rlbus.bus import Bus
    from rlbus.config.schema import RlbusConfig

    async def main():
        cfg = RlbusConfig(run={"id": sys.argv[2]}, bus={"url": sys.argv[1]})
        bus = await Bus.open(cfg, name="doomed-worker")
        consumer = await bus.consumer("prompts", "rollout", ack_wait_s=2)
        for _ in range(50):
            got = await consumer.fetch(1, timeout=1)
            if got:
                print("GOT", got[0].message.prompt_id, flush=True)
                await asyncio.sleep(600)  # dies here, holding the item without an ack
    asyncio.run(main())
    """
)


async def test_unacked_item_is_redelivered_after_its_consumer_process_dies(
    bus: Bus, run_id: str, nats_url: str
) -> None:
    await bus.publish(Stage.PROMPTS, prompt(run_id, 42))
    proc = subprocess.Popen(
        [sys.executable, "-c", _WORKER, nats_url, run_id],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )

    def first_got() -> str:
        for line in proc.stdout:  # type: ignore[union-attr]  # log lines come first
            if line.startswith("GOT "):
                return line.strip()
        return "exited: " + proc.stderr.read()  # type: ignore[union-attr]

    try:
        assert await asyncio.wait_for(asyncio.to_thread(first_got), 30) == "GOT p42"
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    # Another connection, same durable: the item comes back once ack_wait (2 s) runs out.
    async with Bus.connect(bus_cfg(nats_url, run_id), name="survivor") as other:
        consumer = await other.consumer(Stage.PROMPTS, "rollout", ack_wait_s=2)
        got = await consumer.fetch(1, timeout=10)
        assert [d.message.prompt_id for d in got] == ["p42"]  # type: ignore[attr-defined]
        assert got[0].num_delivered == 2
        await got[0].ack()
    assert await bus.stream_depth(Stage.PROMPTS) == 0


def bus_cfg(url: str, run_id: str, **bus: object) -> RlbusConfig:
    return RlbusConfig(run={"id": run_id}, bus={"url": url, **bus})


async def test_replicas_sharing_a_durable_share_the_work(
    bus: Bus, bus_config: RlbusConfig, run_id: str
) -> None:
    for i in range(6):
        await bus.publish(Stage.PROMPTS, prompt(run_id, i))
    async with Bus.connect(bus_config, name="r1") as b1, Bus.connect(bus_config, name="r2") as b2:
        c1 = await b1.consumer(Stage.PROMPTS, "rollout")
        c2 = await b2.consumer(Stage.PROMPTS, "rollout")
        got1 = await c1.fetch(3, timeout=5)
        got2 = await c2.fetch(3, timeout=5)
        ids = sorted(d.message.prompt_id for d in got1 + got2)  # type: ignore[attr-defined]
        assert ids == [f"p{i}" for i in range(6)]
        for d in got1 + got2:
            await d.ack()


# ---------------------------------------------------------------- big payloads and dedup


def big_group(run_id: str, total_bytes: int, i: int = 0) -> TrajectoryGroup:
    per_sample = total_bytes // 4 // 2  # float32, two samples
    return trajectories(run_id, logprob_len=per_sample, n_samples=2, i=i)


async def _round_trip_big(bus: Bus, run_id: str, total: int) -> tuple[str | None, TrajectoryGroup]:
    msg = big_group(run_id, total)
    res = await bus.publish(Stage.TRAJECTORIES, msg)
    assert res.size >= total
    consumer = await bus.consumer(Stage.TRAJECTORIES, "reward", ack_wait_s=30)
    (d,) = await consumer.fetch(1, timeout=15)
    got = d.message
    assert isinstance(got, TrajectoryGroup)
    for a, b in zip(got.samples, msg.samples, strict=True):
        np.testing.assert_array_equal(a.logprobs, b.logprobs)
    assert (d.claim is not None) == (res.claim is not None)
    await d.ack()
    await consumer.close()
    return res.claim, got


async def test_8mib_payload_goes_by_claim_check_on_the_default_server(bus: Bus, run_id: str) -> None:
    claim, _ = await _round_trip_big(bus, run_id, 8 * MiB)
    if bus.nc.max_payload <= 8 * MiB:
        assert claim is not None
    if claim is not None:
        obs = await bus.js.object_store(bus.names.blobs_bucket)
        with pytest.raises(ObjectNotFoundError):  # the ack removed the blob
            await obs.get(claim)
    assert await bus.stream_depth(Stage.TRAJECTORIES) == 0


async def test_big_payloads_on_a_server_with_8mib_max_payload(
    private_nats: LocalNatsServer, run_id: str
) -> None:
    async with Bus.connect(bus_cfg(private_nats.url, run_id), name="big") as bus:
        assert bus.nc.max_payload == 8 * MiB
        claim, _ = await _round_trip_big(bus, run_id, 6 * MiB)
        assert claim is None  # fits inline under the raised limit
        claim, _ = await _round_trip_big(bus, run_id, 8 * MiB)
        assert claim is not None  # 8 MiB of arrays + envelope is over 8 MiB: claim check


async def test_missing_claim_object_is_dead_lettered(bus: Bus, run_id: str) -> None:
    res = await bus.publish(Stage.TRAJECTORIES, big_group(run_id, 2 * MiB + bus.nc.max_payload))
    assert res.claim is not None
    obs = await bus.js.object_store(bus.names.blobs_bucket)
    await obs.delete(res.claim)
    await bus.publish(Stage.TRAJECTORIES, trajectories(run_id))
    consumer = await bus.consumer(Stage.TRAJECTORIES, "reward")
    got = await consumer.fetch(1, timeout=5)
    assert len(got) == 1 and got[0].claim is None
    await got[0].ack()
    (dl,) = await bus.dead_letters(Stage.TRAJECTORIES)
    assert "missing" in dl.reason and dl.headers[CLAIM_HEADER] == res.claim


async def test_msg_id_deduplicates_inline_and_claimed(bus: Bus, run_id: str) -> None:
    first = await bus.publish(Stage.PROMPTS, prompt(run_id, 1), msg_id="work-1")
    again = await bus.publish(Stage.PROMPTS, prompt(run_id, 1), msg_id="work-1")
    assert not first.duplicate and again.duplicate and again.seq == first.seq
    other = await bus.publish(Stage.PROMPTS, prompt(run_id, 2), msg_id="work-2")
    assert not other.duplicate
    assert await bus.stream_depth(Stage.PROMPTS) == 2

    big = big_group(run_id, bus.nc.max_payload + MiB)
    b1 = await bus.publish(Stage.TRAJECTORIES, big, msg_id="traj-1")
    b2 = await bus.publish(Stage.TRAJECTORIES, big, msg_id="traj-1")
    assert b1.claim and b2.claim and b2.duplicate and not b1.duplicate
    assert await bus.stream_depth(Stage.TRAJECTORIES) == 1
    obs = await bus.js.object_store(bus.names.blobs_bucket)
    await obs.get(b1.claim)  # the live claim's blob is intact
    with pytest.raises(ObjectNotFoundError):
        await obs.get(b2.claim)  # the duplicate's blob was removed


# ---------------------------------------------------------------- run state


async def test_run_state_versions_announcements_heartbeats_facts(bus: Bus, run_id: str) -> None:
    state: RunState = await bus.state()
    assert await state.get_policy_version() == 0
    await state.set_policy_version(4)
    assert await state.get_policy_version() == 4
    assert await state.get_announcement() is None

    ann = one_of_each(run_id)[WeightAnnouncement]
    await state.put_announcement(encode(ann))
    seen: list[bytes] = []

    async def watch() -> None:
        async for value in state.watch_announcements():
            seen.append(value)
            if len(seen) == 2:
                return

    task = asyncio.create_task(watch())  # ends by itself after two values
    deadline = time.monotonic() + 5
    while not seen:  # the watcher is live once it has the current value
        assert time.monotonic() < deadline, "watch_announcements gave no current value"
        await asyncio.sleep(0.01)
    newer = ann.model_copy(update={"version": 5})
    await state.put_announcement(encode(newer))
    await asyncio.wait_for(task, 5)
    assert [decode(v, WeightAnnouncement).version for v in seen] == [3, 5]  # type: ignore[attr-defined]
    assert decode(await state.get_announcement() or b"", WeightAnnouncement).version == 5  # type: ignore[attr-defined]

    now = time.time()
    for inst, age in (("r0", 0.0), ("r1", 1.0), ("r2", 100.0)):
        await state.heartbeat(Heartbeat(run_id=run_id, service="rollout", instance_id=inst, time=now - age))
    await state.heartbeat(Heartbeat(run_id=run_id, service="reward", instance_id="w0", time=now))
    assert [hb.instance_id for hb in await state.live("rollout", max_age_s=10)] == ["r0", "r1"]
    await state.remove("rollout", "r1")
    assert [hb.instance_id for hb in await state.live("rollout", max_age_s=10)] == ["r0"]
    assert [hb.instance_id for hb in await state.live("reward", max_age_s=10)] == ["w0"]
    assert await state.live("ref", max_age_s=10) == []

    await state.put_json("dataloader", {"epoch": 1, "pos": 17})
    assert await state.get_json("dataloader") == {"epoch": 1, "pos": 17}
    assert await state.get_json("nothing", default={}) == {}


# ---------------------------------------------------------------- connection


def test_redact_url() -> None:
    assert redact_url("nats://alice:s3cret@host:4222") == "nats://alice:***@host:4222"
    assert redact_url("nats://tok3n@host:4222") == "nats://***@host:4222"
    assert redact_url("nats://127.0.0.1:4222") == "nats://127.0.0.1:4222"
    assert redact_url("nats://a:b@h1:1,nats://h2:2") == "nats://a:***@h1:1,nats://h2:2"


async def test_auth_from_config_and_no_secret_in_logs(tmp_path, run_id: str) -> None:
    secret = "s3cret-Tok3n-value"
    with LocalNatsServer(tmp_path / "auth", extra_config=f'authorization {{ token: "{secret}" }}') as srv:
        with structlog.testing.capture_logs() as logs:
            cfg = bus_cfg(srv.url, run_id, token=secret)
            async with Bus.connect(cfg, name="authed") as bus:
                await bus.publish(Stage.PROMPTS, prompt(run_id))
                assert await bus.stream_depth(Stage.PROMPTS) == 1
            t0 = time.monotonic()
            with pytest.raises(BusConnectError) as err:
                await connect(
                    cfg.bus.model_copy(update={"token": "wrong-" + secret}), srv.url, "intruder", wait_s=10
                )
            assert time.monotonic() - t0 < 8  # an auth failure is reported, not retried for wait_s
            assert "authorization" in str(err.value) and secret not in str(err.value)
    assert any(e["event"] == "bus.connected" for e in logs)
    assert secret not in repr(logs)


async def test_connect_fails_with_a_clear_error_when_nothing_listens(bus_config: RlbusConfig) -> None:
    with pytest.raises(BusConnectError, match="127.0.0.1:1"):
        await connect(bus_config.bus, "nats://user:pw@127.0.0.1:1", "nobody", wait_s=1.5)


async def test_bus_survives_a_server_restart(private_nats: LocalNatsServer, run_id: str) -> None:
    async with Bus.connect(bus_cfg(private_nats.url, run_id), name="survivor") as bus:
        consumer = await bus.consumer(Stage.PROMPTS, "rollout", ack_wait_s=5)
        state = await bus.state()
        seen: asyncio.Queue[bytes] = asyncio.Queue()

        async def watch() -> None:
            # a quiet watch is checked only every 30 s: the reconnect itself must renew it
            async for value in state.watch_announcements(check_every_s=30):
                await seen.put(value)

        watcher = asyncio.create_task(watch())
        await state.put_announcement(b"v1")
        assert await asyncio.wait_for(seen.get(), 5) == b"v1"
        await bus.publish(Stage.PROMPTS, prompt(run_id, 1))

        private_nats.restart()

        await bus.publish(Stage.PROMPTS, prompt(run_id, 2))  # retried through the reconnect
        got = []
        for _ in range(10):
            got += await consumer.fetch(2, timeout=2)
            if len(got) == 2:
                break
        assert sorted(d.message.prompt_id for d in got) == ["p1", "p2"]  # type: ignore[attr-defined]
        for d in got:
            await d.ack()
        # The KV watch died with the server; the announcement still reaches the watcher, well inside the
        # 30 s a quiet watch waits before it is checked.
        await state.put_announcement(b"v2")
        assert await asyncio.wait_for(seen.get(), 10) == b"v2"
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher


async def test_a_request_in_flight_when_the_server_dies_is_retried_on_the_new_connection(
    private_nats: LocalNatsServer, run_id: str
) -> None:
    """nats-py lets a request lost with its socket wait out its whole timeout (a KV read: 5 s, in every
    service at once); ours end when the connection drops and go out again on the next one."""
    async with Bus.connect(bus_cfg(private_nats.url, run_id), name="inflight") as bus:
        never_answered = await bus.nc.subscribe(f"rlbus.test.{run_id}.silent")  # holds the request open
        lost = asyncio.create_task(
            unless_disconnected(
                bus.nc, lambda: bus.nc.request(f"rlbus.test.{run_id}.silent", b"?", timeout=600)
            )
        )
        await bus.nc.flush()
        while never_answered.pending_msgs == 0:  # the request reached the server: it is in flight
            await asyncio.sleep(0.01)
        state = await bus.state()
        await state.set_policy_version(7)

        private_nats.restart()

        with pytest.raises(ConnectionLostError):
            await asyncio.wait_for(lost, 60)  # not the request's 600 s timeout
        # the retrying calls go out once the client is back, on the new connection
        assert await asyncio.wait_for(state.get_policy_version(), 60) == 7


async def test_deleting_a_durable_hands_its_unacked_items_to_the_next_consumer_at_once(
    bus: Bus, run_id: str
) -> None:
    """What a resumed learner relies on: ready groups a dead attempt fetched and never acked are not held for
    the long ack wait once its durable is deleted; the re-created consumer gets them at once."""
    for _ in range(3):
        await bus.publish(Stage.READY, ReadyGroup(scored=scored(run_id)))
    dead = await bus.consumer(Stage.READY, "learner", expected=ReadyGroup, ack_wait_s=600)
    assert len(await dead.fetch(3, timeout=5)) == 3  # fetched by the attempt that then dies: never acked
    await dead.close()
    again = await bus.consumer(Stage.READY, "learner", expected=ReadyGroup, ack_wait_s=600)
    assert await again.fetch(3, timeout=2) == []  # same durable: held for its 600 s ack wait
    await again.close()
    await bus.js.delete_consumer(bus.names.stream(Stage.READY), "learner")
    fresh = await bus.consumer(Stage.READY, "learner", expected=ReadyGroup, ack_wait_s=600)
    got = await fresh.fetch(3, timeout=5)
    assert len(got) == 3
    for d in got:
        await d.ack()
    assert await bus.stream_depth(Stage.READY) == 0


async def test_held_work_kept_alive_past_its_ack_wait_then_handed_back(bus: Bus, run_id: str) -> None:
    """A consumer working longer than the ack wait keeps its item (kept_alive beats); once the beats
    stop without an ack (the process died), the item is redelivered after one ack wait."""
    from rlbus.bus.keepalive import kept_alive

    consumer = await bus.consumer(Stage.PROMPTS, "rollout", ack_wait_s=1)
    await bus.publish(Stage.PROMPTS, prompt(run_id, 1))
    (held,) = await consumer.fetch(1, timeout=5)
    async with kept_alive([held], every_s=0.3):
        # three ack waits of work: nobody else is handed the item meanwhile
        assert await consumer.fetch(1, timeout=3) == []
    again = await consumer.fetch(1, timeout=5)  # no ack and no beats: back after one ack wait
    assert [d.message.prompt_id for d in again] == ["p1"] and again[0].num_delivered == 2  # type: ignore[attr-defined]
    await again[0].ack()
