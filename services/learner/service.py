"""The learner: the driver of a run. Dispatch prompts, gather ready groups, update, push weights, repeat."""

from __future__ import annotations

import asyncio
import functools
import time
from pathlib import Path

from rlbus.bus.fan_in import WorkConsumer
from rlbus.bus.trajectory_log import TrajectoryLog
from rlbus.config import RlbusConfig
from rlbus.learner.checkpoint import CheckpointError, resume_target
from rlbus.learner.dispatch import Dispatcher, Ledger
from rlbus.learner.gather import Gatherer
from rlbus.learner.memory_checkpoint import MemoryCheckpoint
from rlbus.learner.resume import LEARNER_DURABLE, prepare_bus, restore
from rlbus.learner.rollout_data import write_rollout_data
from rlbus.learner.step_checkpoints import StepCheckpoints, resume_source
from rlbus.learner.step_metrics import batch_metrics, compiled_graph_count, memory_metrics, run_counters
from rlbus.messages import ReadyGroup
from rlbus.notices import post_notice
from rlbus.service import ServiceContext
from rlbus.stoppable import StoppedDuringStart, on_own_thread, unless_stopped
from rlbus.verl_metric_names import validation_row

# ledger.json is the run's account for people and tests, written whole: every step made a long run's cost
# grow with its length. Resume reads the ledger from the checkpoint, never from this file; the run's end
# (or a stop) writes it once more.
LEDGER_SAVE_EVERY_S = 5.0


def total_steps(cfg: RlbusConfig, dataset_size: int) -> int:
    per_epoch = max(1, dataset_size // cfg.data.train_batch_size)
    steps = cfg.trainer.total_epochs * per_epoch
    if cfg.trainer.total_training_steps is not None:
        steps = min(steps, cfg.trainer.total_training_steps)
    return steps


class Learner:
    def __init__(self, ctx: ServiceContext) -> None:
        self.ctx = ctx
        self.cfg = ctx.cfg
        self.run_dir = ctx.run_dir
        self.ledger = Ledger()
        self.version = 0
        self.start_step = 0  # training steps already done (a resumed checkpoint's step)
        self.attempt = 0  # learner starts of this run id before this one
        self.resumed_from: Path | MemoryCheckpoint | None = None
        self.disk_checkpoint: Path | None = None  # the newest disk checkpoint at start (resume_target's)
        self.trajectory_log: TrajectoryLog | None = None  # bus.trajectory_log
        self.forced_push_at = 0.0
        self.checkpoints: StepCheckpoints | None = None  # memory and rolling ones, once set up

    async def setup(self) -> None:
        from rlbus.learner.data import PromptLoader, check_scorers, prepared_split
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
        self.disk_checkpoint = resume_target(
            self.run_dir, cfg.trainer.resume_mode, self.ctx.log, cfg.trainer.default_local_dir
        )
        self.resumed_from = resume_source(cfg, self.run_dir, self.disk_checkpoint)
        attempt = await prepare_bus(self.ctx, fresh=self.resumed_from is None)
        self.attempt = attempt.number
        if self.resumed_from is None:
            from rlbus.learner.checkpoint import rewind_metrics

            rewind_metrics(self.run_dir, 0)  # an earlier attempt's rows (none of them resumable) move aside
        model_path = resolve_model_path(cfg.model.path, cfg.model.use_shm)
        self.tokenizer = load_tokenizer(model_path)
        records = prepared_split(cfg.data, self.tokenizer, "train", self.run_dir)
        self.val_records = prepared_split(cfg.data, self.tokenizer, "val", self.run_dir)
        check_scorers(records + self.val_records, cfg.reward.type)
        from rlbus.learner.admission import ready_limits
        from rlbus.modeling import model_vocab_size

        self.limits = ready_limits(cfg, model_vocab_size(model_path, cfg.model.trust_remote_code))
        self.loader = PromptLoader(records, seed=cfg.data.seed, shuffle=cfg.data.shuffle)
        self.total_steps = total_steps(cfg, len(records))
        device = pick_device(cfg.trainer.device)
        from rlbus.weight_transport import require_cuda

        require_cuda(
            cfg.trainer.weight_sync_backend, "trainer.device", device.type
        )  # compose/k8s: no launcher check
        self.trainer = await on_own_thread(PolicyTrainer, cfg, model_path, device, self.total_steps)
        self.dispatcher = Dispatcher(cfg, self.loader, self.tokenizer, self.ctx.bus, self.ledger)
        self.dispatcher.id_tag = f"a{self.attempt}-" if self.attempt else ""
        if self.resumed_from is not None:
            await self._restore(self.resumed_from)
        self.pusher = WeightPusher(self.ctx, device)
        self.pusher.epoch = attempt.stale_epoch  # our weight groups get epochs no replica has seen
        await self.pusher.start()
        self.writer = MetricsWriter(
            self.run_dir,
            cfg.trainer.logger,
            self.total_steps,
            cfg.trainer.project_name,
            cfg.trainer.experiment_name,
        )
        self.gatherer = Gatherer(self, await self._ready_consumer())
        if cfg.bus.trajectory_log:
            self.trajectory_log = TrajectoryLog(
                self.ctx.bus, cfg.bus.trajectory_log_max_age_h, cfg.bus.trajectory_log_max_gb
            )
            await self.trajectory_log.ensure()
        self.checkpoints = StepCheckpoints(cfg, self.run_dir, self.trainer, self._should_save, self.ctx.log)
        await self.ctx.bus.nc.subscribe(self.ctx.bus.names.dlq_wildcard, cb=self._on_dead_letter)
        await self.ctx.state.set_policy_version(self.version)
        self.ctx.policy_version = self.version
        if self.resumed_from is not None or attempt.replicas_may_differ:
            await self.push_current()
        self.ctx.mark_ready()

    # ------------------------------------------------------------------ checkpoints and resume

    async def _restore(self, path: Path | MemoryCheckpoint) -> None:
        t0 = time.perf_counter()
        if (
            isinstance(path, Path)
            and self.cfg.trainer.resume_mode == "auto"
            and self.trainer.par.world_size > 1
        ):
            path = await self._common_checkpoint(path)
        try:
            restored = await restore(self.trainer, self.loader, path, self.run_dir)
        except CheckpointError as exc:  # a memory checkpoint this trainer cannot take: the disk one then
            if not isinstance(path, MemoryCheckpoint) or self.disk_checkpoint is None:
                raise
            self.ctx.log.warning("memory checkpoint unusable: resuming from disk", error=str(exc))
            path = self.disk_checkpoint
            restored = await restore(self.trainer, self.loader, path, self.run_dir)
        self.start_step, self.version, self.ledger = restored.step, restored.version, restored.ledger
        self.dispatcher.ledger = self.ledger
        self.dispatcher.requeue.extend(restored.redispatch)
        self.ctx.log.info(
            "resumed from checkpoint",
            path=str(path),
            step=self.start_step,
            version=self.version,
            loader_position=self.loader.position,
            redispatch=len(restored.redispatch),
            attempt=self.attempt,
            seconds=round(time.perf_counter() - t0, 2),
        )

    async def _common_checkpoint(self, newest_here: Path) -> Path:
        """The newest checkpoint every rank completed: where ranks keep folders of their own, one may have
        died before sealing the step rank 0 sealed."""
        from rlbus.learner.checkpoint import CheckpointError, common_checkpoint

        self.trainer.par.lead_call("common_checkpoint", root=str(newest_here.parent))
        agreed = await asyncio.to_thread(common_checkpoint, newest_here.parent)
        if agreed is None:
            raise CheckpointError(
                f"no checkpoint under {newest_here.parent} is complete on every learner rank"
            )
        if agreed != newest_here:
            self.ctx.log.warning(
                "resuming from an older checkpoint: a rank has not the newest",
                newest=str(newest_here),
                agreed=str(agreed),
            )
        return agreed

    async def push_current(self, reason: str = "start") -> None:
        """Replicas may hold other weights (the crashed attempt pushed after the checkpoint, or an earlier
        run's): push ours at once, at our version, so every replica generates with exactly them."""
        self.forced_push_at = time.monotonic()
        self.pusher.transports = (
            None  # a new group epoch: a replica skips an (epoch, version) it already took
        )
        ok = await self.pusher.push(self.named_weights, self.version)
        self.ctx.log.info(
            "weights pushed to overwrite other attempts'" if ok else "overwrite push failed; will retry",
            version=self.version,
            reason=reason,
        )

    def _should_save(self, done: int) -> bool:
        freq = self.cfg.trainer.save_freq
        return freq > 0 and (done % freq == 0 or done == self.total_steps)

    def _checkpoint_extra(self, done: int) -> dict:
        """What a checkpoint carries besides the tensors: where the run is, and its ledger."""
        return {
            "step": done,
            "policy_version": self.version,
            "loader": self.loader.state_dict(),
            "ledger": self.ledger.to_dict(),
            "attempt": self.attempt,
            "run_id": self.cfg.run.id,
        }

    async def checkpoint(self, done: int) -> Path:
        from rlbus.learner.checkpoint import checkpoint_root, prune_checkpoints, save_checkpoint, step_dir

        extra = self._checkpoint_extra(done)
        root = checkpoint_root(self.run_dir, self.cfg.trainer.default_local_dir)
        if self.checkpoints is not None:
            await self.checkpoints.flush()  # no rolling write beside the kept one (or the prune)
        t0 = time.perf_counter()
        self.trainer.par.lead_call(  # ranks > 0 save alongside (and prune a folder of their own)
            "save_checkpoint", path=str(step_dir(root, done)), keep=self.cfg.trainer.max_ckpt_to_keep
        )
        path = await asyncio.to_thread(
            save_checkpoint, step_dir(root, done), self.trainer, extra, self.tokenizer
        )
        await asyncio.to_thread(prune_checkpoints, root, self.cfg.trainer.max_ckpt_to_keep, self._should_save)
        self.ctx.log.info(
            "checkpoint saved", step=done, path=str(path), seconds=round(time.perf_counter() - t0, 2)
        )
        return path

    def named_weights(self):
        return self.trainer.named_weights()

    async def settle(self, delivery, reason: str | None, step: int | None = None) -> None:
        group: ReadyGroup = delivery.message
        traj = group.scored.trajectories
        pid = traj.work.prompt_id
        self.ledger.made[pid] = (
            f"{traj.replica_id}@v{traj.policy_version} scored by {group.scored.reward_impl}"
        )
        if reason is None:
            self.ledger.trained[pid] = step if step is not None else self.version
        else:
            self.ledger.dropped[pid] = reason
        await delivery.ack()

    async def _on_dead_letter(self, msg) -> None:
        """A service parked one of our prompts (or what became of it) on the DLQ: it will never be trained.
        The ledger says so under its own reason, and the slot it held goes to new work."""
        from rlbus.bus.headers import ORIGINAL_MSG_ID_HEADER, REASON_HEADER, STAGE_HEADER

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
            g = self.gatherer
            g.val_pending = await self.dispatcher.dispatch_validation(self.val_records, self.version, step)
            g.val_results, g.val_step = [], step

    async def run(self) -> int:
        from rlbus.learner.batch import collate

        cfg = self.cfg
        pad_id = int(self.tokenizer.pad_token_id)
        ledger_path = self.run_dir / "ledger.json"
        tokens_total, t_run = 0, time.perf_counter()
        ledger_saved = time.monotonic()
        if cfg.trainer.val_only:
            return await self.validate_only()
        self._warming = asyncio.ensure_future(self._warm_up())  # awaited by the first update
        for step in range(self.start_step, self.total_steps):
            t_step = time.perf_counter()
            validate = (step == 0 and cfg.trainer.val_before_train) or (
                cfg.trainer.test_freq > 0 and step > 0 and step % cfg.trainer.test_freq == 0
            )
            if validate:
                await self.start_validation(step)
            # in data order, so a batch trains the same whatever order its groups arrived in
            deliveries = sorted(
                await self.gatherer.gather(step, cfg.data.train_batch_size),
                key=lambda d: d.message.scored.trajectories.work.index,
            )
            t_gathered = time.perf_counter()
            groups = [d.message for d in deliveries]
            batch = collate(groups, pad_id)
            metrics = batch_metrics(groups, self.version)
            metrics.update(await self._train(step, batch))
            t_trained = time.perf_counter()
            if validate:  # answered beside the update; newer weights go out only after it
                await self.gatherer.finish_validation(step)
                # verl's names at verl's step (the policy after `step` updates); ours in the step's row
                held_out = self.gatherer.validation_metrics()
                verl_row = validation_row(held_out)
                self.writer.log(step, verl_row)
                metrics.update({k: v for k, v in held_out.items() if k not in verl_row})
                metrics["timing/validation_wait_s"] = time.perf_counter() - t_trained
            if cfg.trainer.rollout_data_dir:
                write_rollout_data(cfg.trainer.rollout_data_dir, step + 1, groups)
            self.version += 1
            # the trained groups' acks (each a round trip to the server) go beside the new version's push
            settle_s, push_s, _ = await asyncio.gather(
                self._settle_trained(deliveries, step),
                self._push_new_version(),
                self._log_trained(groups, step),
            )
            t_pushed = time.perf_counter()
            tokens = int(batch.response_mask.sum())
            tokens_total += tokens
            metrics.update(self._step_metrics(tokens, tokens_total / (time.perf_counter() - t_run)))
            metrics.update(
                {
                    "timing/wait_batch_s": t_gathered - t_step,
                    "timing/train_s": t_trained - t_gathered,
                    "timing/settle_s": settle_s,  # beside the push, not before it
                    "timing/weight_push_s": push_s,  # the new version handed over and announced
                    "timing/step_s": t_pushed - t_step,
                    "perf/samples_per_s": batch.size / max(t_pushed - t_step, 1e-9),
                }
            )
            self.writer.log(step + 1, metrics)
            if time.monotonic() - ledger_saved >= LEDGER_SAVE_EVERY_S:
                self.ledger.save(ledger_path)
                ledger_saved = time.monotonic()
            done = step + 1
            if kept := self._should_save(done):
                await self.checkpoint(done)
            if self.checkpoints is not None:
                await self.checkpoints.after_step(
                    done,
                    t_pushed - t_step,
                    self.trainer,
                    functools.partial(self._checkpoint_extra, done),
                    self.tokenizer,
                    kept,
                )
        await self._finish(ledger_path)
        return 0

    async def _warm_up(self) -> None:
        """The learner's compile, at start and beside the first batch's generation, not in step 1."""
        if not self.trainer.warms_up:
            return
        parts = {
            "decoder layers": self.trainer.compiles_layers,
            "log-prob kernels": self.trainer.compiles_kernels,
        }
        what = " and ".join(name for name, compiled in parts.items() if compiled)
        post_notice(self.run_dir, "learner", f"compiling the {what}, once, at start")
        t0 = time.perf_counter()
        run = on_own_thread if stops_during_start() else asyncio.to_thread  # see stops_during_start
        if await run(self.trainer.warm_up):  # one process: a stop mid-compile does not wait it out
            post_notice(self.run_dir, "learner", f"{what} compiled in {time.perf_counter() - t0:.1f} s")

    async def _train(self, step: int, batch) -> dict[str, float]:
        """One update, off the event loop, after the warm-up; a step that compiled graphs says so on the
        console (a compile after start-up is a stall worth knowing about)."""
        try:  # a stop during the warm-up ends the run as a stop while gathering does
            await unless_stopped(self.ctx.stop, asyncio.shield(self._warming))
        except StoppedDuringStart:
            raise asyncio.CancelledError from None
        graphs, t0 = compiled_graph_count(), time.perf_counter()
        metrics = await asyncio.to_thread(self.trainer.train_step, batch)
        if (new_graphs := compiled_graph_count() - graphs) > 0:
            seconds = time.perf_counter() - t0
            post_notice(
                self.run_dir, "learner", f"step {step + 1} compiled {new_graphs} graphs ({seconds:.1f} s)"
            )
        return metrics

    async def _settle_trained(self, deliveries: list, step: int) -> float:
        """Ack the groups just trained on, concurrently; returns the seconds it took."""
        t0 = time.perf_counter()
        await asyncio.gather(*(self.settle(d, None, step) for d in deliveries))
        return time.perf_counter() - t0

    async def _log_trained(self, groups: list, step: int) -> None:
        """The step's groups into the run's trajectory log (bus.trajectory_log), 1-based as in metrics."""
        if self.trajectory_log is not None:
            await self.trajectory_log.append(step + 1, groups)

    async def _push_new_version(self) -> float:
        """Hand the new version to the replicas and announce it; returns the seconds it took."""
        t0 = time.perf_counter()
        await self.pusher.push(self.named_weights, self.version)
        await self.ctx.state.set_policy_version(self.version)
        self.ctx.policy_version = self.version
        return time.perf_counter() - t0

    async def _finish(self, ledger_path: Path) -> None:
        """After the last step: the final model, the last validation, what is still in flight."""
        from rlbus.learner.export import save_hf

        self.trainer.par.lead_call("save_hf", path=str(self.run_dir / "final"))  # ranks > 0 gather alongside
        await asyncio.to_thread(save_hf, self.trainer.model, self.tokenizer, self.run_dir / "final")
        if self.cfg.trainer.test_freq > 0 and self.val_records:
            await self.start_validation(self.total_steps)
            await self.gatherer.finish_validation(self.total_steps)
            self.writer.log(
                self.total_steps,
                {"policy/version": float(self.version), **self.gatherer.validation_metrics()},
            )
        await self.drain()
        if self.checkpoints is not None:
            await self.checkpoints.finish()
        self.ledger.save(ledger_path)
        self.writer.close()
        self.pusher.close()

    def _step_metrics(self, tokens: int, tokens_per_s: float) -> dict[str, float]:
        return (
            run_counters(
                self.ledger,
                self.pusher,
                self.trainer.par.world_size,
                self.version,
                tokens,
                tokens_per_s,
                self.checkpoints,
            )
            | memory_metrics(self.trainer.device)
            | {"bus/dead_letters": float(getattr(self.gatherer.consumer, "dead_letters", 0))}
        )

    async def validate_only(self) -> int:
        """trainer.val_only (verl): held-out scores of the starting (or resumed) policy, logged at its step."""
        if not self.val_records:
            self.ctx.log.warning("trainer.val_only=true but there are no validation rows; nothing to do")
        else:
            await self.start_validation(self.start_step)
            await self.gatherer.finish_validation(self.start_step)
            self.writer.log(
                self.start_step, {"policy/version": float(self.version), **self.gatherer.validation_metrics()}
            )
        await self.drain()
        self.ledger.save(self.run_dir / "ledger.json")
        self.writer.close()
        self.pusher.close()
        return 0

    async def _ready_consumer(self) -> WorkConsumer[ReadyGroup]:
        from rlbus.bus import Stage

        return await self.ctx.bus.consumer(
            Stage.READY,
            durable=LEARNER_DURABLE,
            expected=ReadyGroup,
            ack_wait_s=max(self.cfg.bus.ack_wait_s, 600.0),
            max_deliver=self.cfg.bus.max_deliver,
        )

    async def _reopened_ready_consumer(self, old: WorkConsumer[ReadyGroup]) -> WorkConsumer[ReadyGroup]:
        """The ready stage's consumer made afresh: what the old one was handed and never settled (deliveries
        a lost connection dropped) goes to the new one at once, not after the 600 s ack wait."""
        from rlbus.bus import Stage

        await old.close()
        await self.ctx.bus.delete_consumer(Stage.READY, LEARNER_DURABLE)
        return await self._ready_consumer()

    async def drain(self, timeout_s: float = 60.0) -> None:
        """After the last step: collect what is still in flight and record it as dropped ('run_finished')."""
        await self.gatherer.drain(timeout_s, self._reopened_ready_consumer)
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


def stops_during_start() -> bool:
    """A stop may abandon the start-up (model load, optimizer) of a learner that is one process. Ranks of
    several meet in collectives while they set up: rank 0 leaving halfway would strand the others, so they
    finish setting up and stop together."""
    from rlbus.learner.dist import context as dist_context

    return dist_context.context().world_size == 1
