"""The learner: the driver of a run. Dispatch prompts, gather ready groups, update, push weights, repeat."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from pathlib import Path

import numpy as np

from rlbus.config import RlbusConfig
from rlbus.learner.dispatch import DEAD_LETTERED, Dispatcher, Ledger
from rlbus.learner.rollout_data import write_rollout_data
from rlbus.messages import ReadyGroup
from rlbus.service import EXIT_PUSH_FAILED, EXIT_REFUSED, EXIT_STALLED, ServiceContext

WAIT_LOG_EVERY_S = 10.0
KEEPALIVE_EVERY_S = 10.0
ATTEMPTS_KEY = "learner_attempts"  # KV fact: learner starts of this run id (kept across the fresh purge)


LEARNER_DURABLE = "learner"  # the learner's consumer of ready groups


class LearnerStalled(RuntimeError):
    """No ready trajectories arrived for `trainer.batch_timeout_s`: says what it waited for."""


def total_steps(cfg: RlbusConfig, dataset_size: int) -> int:
    per_epoch = max(1, dataset_size // cfg.data.train_batch_size)
    steps = cfg.trainer.total_epochs * per_epoch
    if cfg.trainer.total_training_steps is not None:
        steps = min(steps, cfg.trainer.total_training_steps)
    return steps


def batch_metrics(groups: list[ReadyGroup], version: int) -> dict[str, float]:
    rewards = np.array([r for g in groups for r in g.scored.rewards], dtype=np.float64)
    correct = np.array([c for g in groups for c in g.scored.correct], dtype=np.float64)
    lengths = np.array([len(s.response_ids) for g in groups for s in g.scored.trajectories.samples])
    lags = [version - g.scored.trajectories.policy_version for g in groups]
    gen = [g.scored.trajectories.timings.get("generate_s", 0.0) for g in groups]
    rew = [g.scored.trajectories.timings.get("reward_s", 0.0) for g in groups]
    errors = sum(e is not None for g in groups for e in g.scored.reward_errors)
    hist = Counter(lags)
    out = {
        "reward/mean": float(rewards.mean()),
        "reward/std": float(rewards.std()),
        "reward/accuracy": float(correct.mean()),
        "reward/errors": float(errors),
        "response/length_mean": float(lengths.mean()),
        "response/length_max": float(lengths.max()),
        "response/clip_frac": float(
            np.mean([s.finish_reason == "length" for g in groups for s in g.scored.trajectories.samples])
        ),
        "staleness/mean": float(np.mean(lags)),
        "staleness/max": float(max(lags)),
        "timing/generate_s_per_group": float(np.mean(gen)),
        "timing/reward_s_per_group": float(np.mean(rew)),
    }
    for lag, count in hist.items():
        out[f"staleness/hist_{lag}"] = float(count)
    return out


class Learner:
    def __init__(self, ctx: ServiceContext) -> None:
        self.ctx = ctx
        self.cfg = ctx.cfg
        self.run_dir = ctx.run_dir
        self.ledger = Ledger()
        self.version = 0
        self.start_step = 0  # training steps already done (a resumed checkpoint's step)
        self.attempt = 0  # learner starts of this run id before this one
        self.resumed_from: Path | None = None
        self._stale_epoch = 0  # weight-group epoch of the crashed attempt's last announcement
        self._replicas_may_differ = False  # an earlier attempt pushed weights: replicas may hold them
        self._weights_behind = False  # a group came from weights this learner never made: push ours
        self._forced_push_at = 0.0
        self.val_pending: dict[str, int] = {}  # validation prompt id -> record index
        self.val_results: list[tuple[float, bool, int]] = []  # reward, correct, policy version that answered
        self.overflow: list = []  # ready groups received while a full batch waited for validation
        self._refused_said: set[str] = set()

    async def setup(self) -> None:
        from rlbus.learner.data import PromptLoader, check_scorers, load_split, prepare_prompts
        from rlbus.learner.trainer import PolicyTrainer
        from rlbus.learner.weight_push import WeightPusher
        from rlbus.metrics_log import MetricsWriter
        from rlbus.model_source import resolve_model_path
        from rlbus.modeling import load_tokenizer, pick_device

        cfg = self.cfg
        import torch

        torch.manual_seed(cfg.trainer.seed)
        from rlbus.config.warnings import inert_key_warnings

        for warning in inert_key_warnings(cfg):
            self.ctx.log.warning("config key has no effect", detail=warning)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.resumed_from = self._resume_target()
        await self._prepare_bus(fresh=self.resumed_from is None)
        if self.resumed_from is None:
            from rlbus.learner.checkpoint import rewind_metrics

            rewind_metrics(self.run_dir, 0)  # an earlier attempt's rows (none of them resumable) move aside
        model_path = resolve_model_path(cfg.model.path, cfg.model.use_shm)
        self.tokenizer = load_tokenizer(model_path)
        records = prepare_prompts(load_split(cfg.data, "train"), self.tokenizer, cfg.data, "train")
        self.val_records = prepare_prompts(load_split(cfg.data, "val"), self.tokenizer, cfg.data, "val")
        check_scorers(records + self.val_records, cfg.reward.type)
        self.loader = PromptLoader(records, seed=cfg.data.seed, shuffle=cfg.data.shuffle)
        self.total_steps = total_steps(cfg, len(records))
        device = pick_device(cfg.trainer.device)
        from rlbus.weight_transport import require_cuda

        require_cuda(
            cfg.trainer.weight_sync_backend, "trainer.device", device.type
        )  # compose/k8s: no launcher check
        self.trainer = await asyncio.to_thread(PolicyTrainer, cfg, model_path, device, self.total_steps)
        self.dispatcher = Dispatcher(cfg, self.loader, self.tokenizer, self.ctx.bus, self.ledger)
        self.dispatcher.id_tag = f"a{self.attempt}-" if self.attempt else ""
        if self.resumed_from is not None:
            await self._restore(self.resumed_from)
        self.pusher = WeightPusher(self.ctx, device)
        self.pusher.epoch = self._stale_epoch  # our weight groups get epochs no replica has seen
        await self.pusher.start()
        self.writer = MetricsWriter(
            self.run_dir,
            cfg.trainer.logger,
            self.total_steps,
            cfg.trainer.project_name,
            cfg.trainer.experiment_name,
        )
        from rlbus.bus import Stage

        self.consumer = await self.ctx.bus.consumer(
            Stage.READY,
            durable=LEARNER_DURABLE,
            expected=ReadyGroup,
            ack_wait_s=max(self.cfg.bus.ack_wait_s, 600.0),
            max_deliver=self.cfg.bus.max_deliver,
        )
        await self.ctx.bus.nc.subscribe(self.ctx.bus.names.dlq_wildcard, cb=self._on_dead_letter)
        await self.ctx.state.set_policy_version(self.version)
        self.ctx.policy_version = self.version
        if self.resumed_from is not None or self._replicas_may_differ:
            await self._push_current()
        self.ctx.status = "ready"

    # ------------------------------------------------------------------ checkpoints and resume

    def _resume_target(self) -> Path | None:
        from rlbus.learner.checkpoint import resume_target

        return resume_target(
            self.run_dir, self.cfg.trainer.resume_mode, self.ctx.log, self.cfg.trainer.default_local_dir
        )

    async def _prepare_bus(self, fresh: bool) -> None:
        """A fresh start empties the run's streams; a resume keeps them (replica heartbeats, weight
        announcements, the DLQ, results in flight) but drops the crashed attempt's queued prompt work: all
        of it is superseded, and it may ask for policy versions the resumed learner has not reached."""
        from rlbus.bus import Stage

        state = self.ctx.state
        self.attempt = int(await state.get_json(ATTEMPTS_KEY, 0) or 0)
        self._replicas_may_differ = int(await state.get_policy_version(0)) > 0
        await self._forget_announcement()
        if fresh:
            await self.ctx.bus.purge_run()  # a fresh run never trains on a previous run's leftovers
        else:
            with contextlib.suppress(Exception):
                await self.ctx.bus.js.purge_stream(self.ctx.bus.names.stream(Stage.PROMPTS))
            # Ready groups the dead attempt fetched and never acked would stay invisible for the consumer's
            # whole ack wait (600 s): dropping the durable hands them to our new consumer at once (the
            # work-queue stream keeps every un-acked message), where they are counted as leftovers.
            with contextlib.suppress(Exception):
                await self.ctx.bus.js.delete_consumer(self.ctx.bus.names.stream(Stage.READY), LEARNER_DURABLE)
        await state.put_json(ATTEMPTS_KEY, self.attempt + 1)  # prompt ids of the next start differ

    async def _restore(self, path: Path) -> None:
        from rlbus.learner.checkpoint import load_checkpoint, rewind_metrics

        t0 = time.perf_counter()
        self.trainer.par.lead_call("load_checkpoint", path=str(path))  # FSDP ranks > 0 load alongside
        extra = await asyncio.to_thread(load_checkpoint, path, self.trainer)
        self.start_step = int(extra["step"])
        self.version = int(extra["policy_version"])
        self.loader.load_state_dict(extra["loader"])
        self.ledger = Ledger.from_dict(extra["ledger"])
        self.dispatcher.ledger = self.ledger
        again = self.ledger.settle_for_resume()
        self.dispatcher.requeue.extend(again)
        rewind_metrics(self.run_dir, self.start_step)
        self.ledger.save(self.run_dir / "ledger.json")
        self.ctx.log.info(
            "resumed from checkpoint",
            path=str(path),
            step=self.start_step,
            version=self.version,
            loader_position=self.loader.position,
            redispatch=len(again),
            attempt=self.attempt,
            seconds=round(time.perf_counter() - t0, 2),
        )

    async def _forget_announcement(self) -> None:
        """The crashed attempt's weight announcement names a group that is gone: a replica starting now
        would wait on it for its whole timeout. Remember its epoch (ours must be newer), then delete it."""
        from rlbus.bus.state import ANNOUNCE_KEY
        from rlbus.messages import WeightAnnouncement, decode

        with contextlib.suppress(Exception):
            raw = await self.ctx.state.get_announcement()
            if raw:
                self._stale_epoch = decode(raw, WeightAnnouncement).epoch
            await self.ctx.state.kv.purge(ANNOUNCE_KEY)

    async def _push_current(self, reason: str = "start") -> None:
        """Replicas may hold other weights (the crashed attempt pushed after the checkpoint, or an earlier
        run's): push ours at once, at our version, so every replica generates with exactly them."""
        self._forced_push_at = time.monotonic()
        self.pusher.transports = (
            None  # a new group epoch: a replica skips an (epoch, version) it already took
        )
        ok = await self.pusher.push(self._named_weights, self.version)
        self.ctx.log.info(
            "weights pushed to overwrite other attempts'" if ok else "overwrite push failed; will retry",
            version=self.version,
            reason=reason,
        )

    def _should_save(self, done: int) -> bool:
        freq = self.cfg.trainer.save_freq
        return freq > 0 and (done % freq == 0 or done == self.total_steps)

    async def checkpoint(self, done: int) -> Path:
        from rlbus.learner.checkpoint import checkpoint_root, prune_checkpoints, save_checkpoint, step_dir

        extra = {
            "step": done,
            "policy_version": self.version,
            "loader": self.loader.state_dict(),
            "ledger": self.ledger.to_dict(),
            "attempt": self.attempt,
            "run_id": self.cfg.run.id,
        }
        root = checkpoint_root(self.run_dir, self.cfg.trainer.default_local_dir)
        t0 = time.perf_counter()
        self.trainer.par.lead_call(
            "save_checkpoint", path=str(step_dir(root, done))
        )  # ranks > 0 save alongside
        path = await asyncio.to_thread(
            save_checkpoint, step_dir(root, done), self.trainer, extra, self.tokenizer
        )
        await asyncio.to_thread(prune_checkpoints, root, self.cfg.trainer.max_ckpt_to_keep)
        self.ctx.log.info(
            "checkpoint saved", step=done, path=str(path), seconds=round(time.perf_counter() - t0, 2)
        )
        return path

    def _named_weights(self):
        return self.trainer.named_weights()

    async def _settle(self, delivery, reason: str | None, step: int | None = None) -> None:
        group: ReadyGroup = delivery.message
        pid = group.scored.trajectories.work.prompt_id
        if reason is None:
            self.ledger.trained[pid] = step if step is not None else self.version
        else:
            self.ledger.dropped[pid] = reason
        await delivery.ack()

    async def _on_dead_letter(self, msg) -> None:
        """A service parked one of our prompts (or what became of it) on the DLQ: it will never be trained.
        The ledger says so under its own reason, and the slot it held goes to new work."""
        from rlbus.bus.transport import ORIGINAL_MSG_ID_HEADER, REASON_HEADER, STAGE_HEADER

        headers = msg.headers or {}
        pid = self.ledger.settle_dead_letter(headers.get(ORIGINAL_MSG_ID_HEADER, ""))
        if pid is not None:
            self.ctx.log.warning(
                "prompt dead-lettered; it will not be trained",
                prompt_id=pid,
                stage=headers.get(STAGE_HEADER),
                reason=headers.get(REASON_HEADER),
            )

    async def start_validation(self, step: int) -> None:
        if self.val_records:
            self.val_pending = await self.dispatcher.dispatch_validation(self.val_records, self.version, step)
            self.val_results = []

    def validation_metrics(self) -> dict[str, float]:
        if not self.val_results or self.val_pending:
            return {}
        rewards = [r for r, _, _ in self.val_results]
        versions = [v for _, _, v in self.val_results]
        # Validation work asks for the learner's version at dispatch and the step waits for it before the
        # next push, so every answer comes from exactly those weights; the record says which answered.
        return {
            "val/accuracy": float(np.mean([c for _, c, _ in self.val_results])),
            "val/reward_mean": float(np.mean(rewards)),
            "val/version": float(min(versions)),
            "val/version_max": float(max(versions)),
            "val/prompts": float(len(versions)),
        }

    async def _consider(self, d, batch: list, need: int) -> None:
        """Routes one ready group: validation result, batch member, overflow, or settled as dropped."""
        group: ReadyGroup = d.message
        work = group.scored.trajectories.work
        pid = work.prompt_id
        if work.split == "val":
            if self.val_pending.pop(pid, None) is not None:
                self.val_results.append(
                    (
                        group.scored.rewards[0],
                        group.scored.correct[0],
                        group.scored.trajectories.policy_version,
                    )
                )
            await d.ack()
            return
        lag = self.version - group.scored.trajectories.policy_version
        if pid not in self.ledger.dispatched or self.ledger.dropped.get(pid) == "resumed":
            self.ledger.leftovers += 1  # work of an earlier learner attempt: superseded, never trained
            await d.ack()
        elif self.ledger.is_settled(pid) or any(
            pid == b.message.scored.trajectories.work.prompt_id for b in batch
        ):
            self.ledger.duplicates += 1  # a redelivery raced its ack
            await d.ack()
        elif lag < 0:  # made with weights of a crashed attempt newer than the checkpoint
            await self._settle(d, "future_version")
            self._weights_behind = True
        elif lag > self.cfg.trainer.async_level:
            await self._settle(d, "stale")
        elif self.cfg.algorithm.dynamic_sampling and len(set(group.scored.rewards)) == 1:
            await self._settle(d, "zero_variance")
        elif len(batch) >= need:  # the batch is full; waiting only for validation: keep it for the next one
            self.overflow.append(d)
        else:
            batch.append(d)

    async def gather(self, step: int, need: int | None = None) -> list:
        """Ready groups for one batch: fresh enough, not duplicates, (DAPO) not all-equal when asked.

        Validation groups that arrive meanwhile are scored into `val_results`; the batch is complete only
        when the validation started for this step is complete too.
        """
        cfg = self.cfg
        need = cfg.data.train_batch_size if need is None else need
        batch: list = []
        started = last_log = last_keepalive = last_progress = time.monotonic()
        while len(batch) < need or self.val_pending:
            if self.ctx.stop.is_set():
                raise asyncio.CancelledError
            if need and self.pusher.pushed_version >= self.version:  # never work for weights no replica has
                await self.dispatcher.top_up(self.version, step, len(batch))
            held, self.overflow = self.overflow, []
            for d in held:
                await self._consider(d, batch, need)
            deliveries = await self.consumer.fetch(
                batch=max(1, need - len(batch) + len(self.val_pending)), timeout=1.0
            )
            now = time.monotonic()
            for d in deliveries:
                await self._consider(d, batch, need)
                last_progress = now
            if not deliveries:
                await self.pusher.maintain(self._named_weights, self.version)
            if self._weights_behind and now - self._forced_push_at > 5.0:
                self._weights_behind = False
                await self._push_current("a replica generated with weights newer than ours")
            if now - last_keepalive > KEEPALIVE_EVERY_S:
                for d in batch + self.overflow:
                    await d.in_progress()
                last_keepalive = now
            if now - last_log > WAIT_LOG_EVERY_S:
                replicas = await self.pusher.live_replicas()
                self.ctx.log.info(
                    "waiting for ready trajectories",
                    step=step,
                    have=len(batch),
                    need=need,
                    in_flight=self.ledger.in_flight,
                    replicas=sorted(replicas),
                    validation_pending=len(self.val_pending),
                    waited_s=round(now - started),
                    weight_push=self.pusher.status or "ok",
                )
                self._notice_wait(step, len(batch), need)
                last_log = now
            if now - last_progress > cfg.trainer.batch_timeout_s:
                why = (
                    f"replicas may be waiting for weights: {self.pusher.status}"
                    if self.pusher.status
                    else "are the rollout and reward services running? see `rlbus status`"
                )
                raise LearnerStalled(
                    f"no ready trajectories for {cfg.trainer.batch_timeout_s:.0f}s at step {step} "
                    f"(have {len(batch)}/{need}, {self.ledger.in_flight} prompts in flight); {why}"
                )
        return batch

    def _notice_wait(self, step: int, have: int, need: int) -> None:
        """The console hears why the learner waits when the weight push is the reason (or a replica was
        refused), not only the log file."""
        from rlbus.notices import post_notice

        for rid, why in list(self.pusher.refused.items()):
            if rid not in self._refused_said:
                self._refused_said.add(rid)
                post_notice(self.run_dir, "learner", f"replica {rid} refused: {why}")
        if self.pusher.status:
            post_notice(
                self.run_dir, "learner", f"step {step} waits ({have}/{need} groups): {self.pusher.status}"
            )

    async def run(self) -> int:
        from rlbus.learner.batch import collate

        cfg = self.cfg
        pad_id = int(self.tokenizer.pad_token_id)
        ledger_path = self.run_dir / "ledger.json"
        tokens_total, t_run = 0, time.perf_counter()
        if cfg.trainer.val_only:
            return await self.validate_only()
        for step in range(self.start_step, self.total_steps):
            t_step = time.perf_counter()
            validate = (step == 0 and cfg.trainer.val_before_train) or (
                cfg.trainer.test_freq > 0 and step > 0 and step % cfg.trainer.test_freq == 0
            )
            if validate:
                await self.start_validation(step)
            # in data order, so a batch trains the same whatever order its groups arrived in
            deliveries = sorted(
                await self.gather(step), key=lambda d: d.message.scored.trajectories.work.index
            )
            t_gathered = time.perf_counter()
            groups = [d.message for d in deliveries]
            batch = collate(groups, pad_id)
            metrics = batch_metrics(groups, self.version)
            if validate:
                metrics.update(self.validation_metrics())
            metrics.update(await asyncio.to_thread(self.trainer.train_step, batch))
            t_trained = time.perf_counter()
            if cfg.trainer.rollout_data_dir:
                write_rollout_data(cfg.trainer.rollout_data_dir, step + 1, groups)
            self.version += 1
            # the trained groups' acks, concurrently: each is a round trip to the server
            await asyncio.gather(*(self._settle(d, None, step) for d in deliveries))
            t_settled = time.perf_counter()
            await self.pusher.push(self._named_weights, self.version)
            await self.ctx.state.set_policy_version(self.version)
            self.ctx.policy_version = self.version
            t_pushed = time.perf_counter()
            tokens = int(batch.response_mask.sum())
            tokens_total += tokens
            metrics.update(
                {
                    "timing/wait_batch_s": t_gathered - t_step,
                    "timing/train_s": t_trained - t_gathered,
                    "timing/settle_s": t_settled - t_trained,
                    "timing/weight_push_s": t_pushed - t_settled,  # the new version handed over and announced
                    "timing/step_s": t_pushed - t_step,
                    "perf/tokens_per_s": tokens_total / (time.perf_counter() - t_run),
                    "perf/step_tokens": float(tokens),
                    "perf/samples_per_s": batch.size / max(t_pushed - t_step, 1e-9),
                    "learner/ranks": float(self.trainer.par.world_size),
                    "policy/version": float(self.version),
                    "staleness/dropped_total": float(self.ledger.dropped_count("stale")),
                    "dapo/filtered_total": float(self.ledger.dropped_count("zero_variance")),
                    "bus/dead_letters": float(getattr(self.consumer, "dead_letters", 0)),
                    "weights/push_failures": float(self.pusher.failures),
                    "weights/handoff_s": float(self.pusher.last_seconds),
                    "weights/ack_wait_s": float(self.pusher.last_ack_wait_seconds),
                    "prompts/dispatched": float(len(self.ledger.dispatched)),
                    "prompts/trained": float(len(self.ledger.trained)),
                    "prompts/leftovers": float(self.ledger.leftovers),
                    "prompts/dead_lettered": float(self.ledger.dropped_count(DEAD_LETTERED)),
                }
            )
            self.writer.log(step + 1, metrics)
            self.ledger.save(ledger_path)
            if self._should_save(step + 1):
                await self.checkpoint(step + 1)
        from rlbus.learner.export import save_hf

        self.trainer.par.lead_call("save_hf", path=str(self.run_dir / "final"))  # ranks > 0 gather alongside
        await asyncio.to_thread(save_hf, self.trainer.model, self.tokenizer, self.run_dir / "final")
        if cfg.trainer.test_freq > 0 and self.val_records:
            await self.start_validation(self.total_steps)
            await self.gather(self.total_steps, need=0)
            self.writer.log(
                self.total_steps, {"policy/version": float(self.version), **self.validation_metrics()}
            )
        await self.drain()
        self.ledger.save(ledger_path)
        self.writer.close()
        self.pusher.close()
        return 0

    async def validate_only(self) -> int:
        """trainer.val_only (verl): held-out scores of the starting (or resumed) policy, logged at its step."""
        if not self.val_records:
            self.ctx.log.warning("trainer.val_only=true but there are no validation rows; nothing to do")
        else:
            await self.start_validation(self.start_step)
            await self.gather(self.start_step, need=0)
            self.writer.log(
                self.start_step, {"policy/version": float(self.version), **self.validation_metrics()}
            )
        await self.drain()
        self.ledger.save(self.run_dir / "ledger.json")
        self.writer.close()
        self.pusher.close()
        return 0

    async def drain(self, timeout_s: float = 60.0) -> None:
        """After the last step: collect what is still in flight and record it as dropped ('run_finished')."""
        deadline = time.monotonic() + timeout_s
        held, self.overflow = self.overflow, []  # groups set aside while the final validation ran
        for d in held:
            pid = d.message.scored.trajectories.work.prompt_id
            if pid in self.ledger.dispatched and not self.ledger.is_settled(pid):
                await self._settle(d, "run_finished")
            else:
                await d.ack()
        while self.ledger.in_flight > 0 and time.monotonic() < deadline:
            for d in await self.consumer.fetch(batch=64, timeout=1.0):
                pid = d.message.scored.trajectories.work.prompt_id
                if pid in self.ledger.dispatched and not self.ledger.is_settled(pid):
                    await self._settle(d, "run_finished")
                else:
                    await d.ack()
        for pid in self.ledger.dispatched:
            if not self.ledger.is_settled(pid):
                self.ledger.dropped[pid] = "run_finished_in_flight"
        self.ctx.log.info(
            "run finished",
            trained=len(self.ledger.trained),
            dropped=len(self.ledger.dropped),
            dispatched=len(self.ledger.dispatched),
            duplicates=self.ledger.duplicates,
        )


async def learner_loop(ctx: ServiceContext) -> int:
    from rlbus.learner.data import DataError
    from rlbus.learner.weight_push import WeightPushFailed
    from rlbus.notices import post_notice
    from rlbus.weight_transport import PlacementError

    learner = Learner(ctx)
    try:
        await learner.setup()
    except (PlacementError, DataError) as exc:
        ctx.log.error("refused at start", reason=str(exc))
        post_notice(ctx.run_dir, "learner", f"refused: {exc}")
        return EXIT_REFUSED
    try:
        return await learner.run()
    except LearnerStalled as exc:
        ctx.log.error("learner stalled", reason=str(exc))
        post_notice(ctx.run_dir, "learner", f"stopped: {exc}")
        return EXIT_STALLED
    except WeightPushFailed as exc:
        ctx.log.error("weight push keeps failing", reason=str(exc))
        post_notice(ctx.run_dir, "learner", f"stopped: {exc}")
        return EXIT_PUSH_FAILED
    except asyncio.CancelledError:
        ctx.log.info("learner stopped before the end", step=learner.version)
        learner.ledger.save(Path(learner.run_dir) / "ledger.json")
        return 130
