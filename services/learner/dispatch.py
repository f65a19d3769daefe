"""Keeps prompt work in flight: at most (async_level + 1) batches of prompts not yet trained or dropped.

Work dispatched at policy version v carries min_policy_version=v, so no replica generates it with older
weights; with async_level=0 that makes every trained sample exactly on-policy.
"""

from __future__ import annotations

import asyncio
import json
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from rlbus.config import RlbusConfig
from rlbus.learner.data import PromptLoader, truncate_prompt
from rlbus.messages import PromptWork, SamplingParams

DEAD_LETTERED = "dead_lettered"  # a service parked the work on the DLQ: it will never be trained
REFUSED = "refused"  # its ready group failed the learner's admission: the prompt went out again


@dataclass
class Ledger:
    """Every prompt the learner dispatched, and what became of it. The counts must always add up."""

    dispatched: dict[str, int] = field(default_factory=dict)  # prompt id -> data index
    trained: dict[str, int] = field(default_factory=dict)  # prompt id -> step it was trained in
    dropped: dict[str, str] = field(default_factory=dict)  # prompt id -> reason
    duplicates: int = 0
    leftovers: int = (
        0  # results of work a crashed learner attempt dispatched: superseded, acked, never trained
    )
    # prompt id -> who made what the learner settled: "<replica>@v<policy version> scored by <reward impl>"
    made: dict[str, str] = field(default_factory=dict)

    @property
    def in_flight(self) -> int:
        return len(self.dispatched) - len(self.trained) - len(self.dropped)

    def is_settled(self, prompt_id: str) -> bool:
        return prompt_id in self.trained or prompt_id in self.dropped

    def settle_dead_letter(self, original_msg_id: str) -> str | None:
        """A dead letter of `original_msg_id` (a prompt id, or "<prompt id>:<stage>" downstream): that prompt,
        if ours and unsettled, is dropped as 'dead_lettered' and returned; anything else is not ours."""
        pid = original_msg_id.split(":", 1)[0]
        if pid not in self.dispatched or self.is_settled(pid):
            return None
        self.dropped[pid] = DEAD_LETTERED
        return pid

    def dropped_count(self, reason: str) -> int:
        return sum(1 for r in self.dropped.values() if r == reason)

    def to_dict(self) -> dict:
        return {
            "dispatched": dict(self.dispatched),
            "trained": dict(self.trained),
            "dropped": dict(self.dropped),
            "duplicates": self.duplicates,
            "leftovers": self.leftovers,
            "made": dict(self.made),
        }

    @classmethod
    def from_dict(cls, raw: dict) -> Ledger:
        return cls(
            dict(raw["dispatched"]),
            dict(raw["trained"]),
            dict(raw["dropped"]),
            int(raw.get("duplicates", 0)),
            int(raw.get("leftovers", 0)),
            dict(raw.get("made", {})),
        )

    def life(self, prompt_id: str) -> dict:
        """What became of one prompt: its data index, who generated and scored it, and its outcome (the step
        it was trained in, the reason it was dropped, or still in flight)."""
        if prompt_id not in self.dispatched:
            return {"prompt_id": prompt_id, "dispatched": False}
        outcome = (
            {"trained_in_step": self.trained[prompt_id]}
            if prompt_id in self.trained
            else {"dropped": self.dropped[prompt_id]}
            if prompt_id in self.dropped
            else {"in_flight": True}
        )
        made = {"made": self.made[prompt_id]} if prompt_id in self.made else {}
        return {
            "prompt_id": prompt_id,
            "dispatched": True,
            "index": self.dispatched[prompt_id],
            **made,
            **outcome,
        }

    def save(self, path: Path) -> None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.to_dict()))
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path) -> Ledger:
        return cls.from_dict(json.loads(path.read_text()))

    def settle_for_resume(self) -> list[int]:
        """On resume from a checkpoint of this ledger: the prompts then in flight are dropped ('resumed')
        and their data indices returned, oldest first, for the learner to dispatch again under new ids.

        Whatever the crashed attempt made of them (or of anything it dispatched after the checkpoint)
        then meets a settled or unknown prompt id and is acked as a leftover, never trained.
        """
        again = sorted(idx for pid, idx in self.dispatched.items() if not self.is_settled(pid))
        for pid in self.dispatched:
            if not self.is_settled(pid):
                self.dropped[pid] = "resumed"
        return again


def raise_first_failure(results: list[object]) -> None:
    """Raise the first exception among publish results (`return_exceptions=True`), once all have settled."""
    failed = next((r for r in results if isinstance(r, BaseException)), None)
    if failed is not None:
        raise failed


def prompt_seed(seed: int, index: int) -> int:
    """The sampling seed of the prompt at data position `index` (rollout.seed_per_prompt)."""
    return (int(seed) * 1_000_003 + int(index)) % (2**31 - 1)


class Dispatcher:
    def __init__(self, cfg: RlbusConfig, loader: PromptLoader, tokenizer, bus, ledger: Ledger) -> None:
        self.cfg = cfg
        self.loader = loader
        self.tokenizer = tokenizer
        self.bus = bus
        self.ledger = ledger
        r = cfg.rollout
        self.sampling = SamplingParams(
            temperature=r.temperature,
            top_p=r.top_p,
            top_k=r.top_k,
            max_tokens=cfg.data.max_response_length,
            stop=list(r.stop),
            ignore_eos=r.ignore_eos,
        )
        self.id_tag = ""  # per learner attempt ("a1-" after the first): JetStream dedups msg ids for minutes
        self.requeue: deque[int] = deque()  # data indices to dispatch again before new ones (after a resume)
        self.again: dict[int, int] = {}  # data index -> times it was dispatched again in this attempt

    def dispatch_again(self, index: int) -> None:
        """The prompt at data position `index` goes out again, before new ones, under a new prompt id (its
        last group was refused): JetStream would drop a second publish of the same id for minutes."""
        self.again[index] = self.again.get(index, 0) + 1
        self.requeue.append(index)

    def _next_item(self):
        """The next prompt: a re-dispatch after a resume first, then the loader's order."""
        if self.requeue:
            return self.loader.at(self.requeue.popleft())
        return self.loader.next()

    def _prompt_ids(self, text: str) -> list[int]:
        """Token ids within data.max_prompt_length by data.truncation. Files were checked at start
        (rlbus.learner.data.prepare_prompts), so `error` only meets synthetic prompts: they keep their end."""
        mode = self.cfg.data.truncation
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return truncate_prompt(ids, self.cfg.data.max_prompt_length, "left" if mode == "error" else mode)

    @property
    def target_in_flight(self) -> int:
        return (self.cfg.trainer.async_level + 1) * self.cfg.data.train_batch_size

    async def top_up(self, version: int, step: int, buffered: int, limit: int | None = None) -> int:
        """Dispatches until in-flight (incl. received but untrained) work reaches the target.

        The publishes go out together: each is a round trip to the server, and a step dispatches a whole
        batch (16 in series cost the 2-core demo ~8 ms a step). Only what the server stored is recorded.
        """
        wanted = self.target_in_flight - self.ledger.in_flight
        if limit is not None:
            wanted = min(wanted, limit)
        works = [self._work(self._next_item(), version, step) for _ in range(max(0, wanted))]
        sent = await self._publish_together(works)
        for work, result in zip(works, sent, strict=True):
            if not isinstance(result, BaseException):
                self.ledger.dispatched[work.prompt_id] = work.index
            else:  # maybe stored, maybe not: again under the same id (JetStream drops a stored one's twin)
                self.requeue.appendleft(work.index)
        raise_first_failure(sent)
        return len(works)

    async def _publish_together(self, works: list[PromptWork]) -> list[object]:
        """Every work item published at once (their round trips overlap, and a replica's fetch finds them
        together); each result is the server's ack or the exception its publish raised."""
        from rlbus.bus import Stage

        return await asyncio.gather(
            *(self.bus.publish(Stage.PROMPTS, w, msg_id=w.prompt_id) for w in works), return_exceptions=True
        )

    def _work(self, item, version: int, step: int) -> PromptWork:
        again = self.again.get(item.index, 0)
        prompt_id = f"{self.cfg.run.id}-{self.id_tag}p{item.index}" + (f"-r{again}" if again else "")
        sampling = self.sampling  # unseeded: replicas batch it with other work
        if self.cfg.rollout.seed_per_prompt:
            sampling = sampling.model_copy(update={"seed": prompt_seed(self.cfg.rollout.seed, item.index)})
        return PromptWork(
            run_id=self.cfg.run.id,
            prompt_id=prompt_id,
            index=item.index,
            step=step,
            min_policy_version=version,
            prompt_ids=self._prompt_ids(item.prompt),
            prompt_text=item.prompt,
            meta=item.meta,
            n=self.cfg.rollout.n,
            sampling=sampling,
        )

    async def dispatch_validation(self, records: list, version: int, step: int) -> dict[str, int]:
        """Greedy, one sample per prompt, through the same services; returns prompt id -> record index.

        The publishes go out together, as a top-up's do: one after another, each waiting for the server's
        ack, they reached a replica over tens of milliseconds, and its first fetch took the first prompt
        alone (a decode pass of its own, on the CPU box's learning bench at every evaluation)."""
        works = [
            self._validation_work(
                f"{self.cfg.run.id}-{self.id_tag}v{step}-{i}", i, prompt, meta, version, step
            )
            for i, (prompt, meta) in enumerate(records)
        ]
        raise_first_failure(await self._publish_together(works))
        return {w.prompt_id: w.index for w in works}

    async def dispatch_validation_again(
        self, records: list, index: int, version: int, step: int, attempt: int
    ) -> str:
        """Validation record `index` once more (its answer was refused); returns the new prompt id."""
        from rlbus.bus import Stage

        prompt, meta = records[index]
        prompt_id = f"{self.cfg.run.id}-{self.id_tag}v{step}-{index}-r{attempt}"
        work = self._validation_work(prompt_id, index, prompt, meta, version, step)
        await self.bus.publish(Stage.PROMPTS, work, msg_id=prompt_id)
        return prompt_id

    def _validation_work(
        self, prompt_id: str, index: int, prompt: str, meta: dict, version: int, step: int
    ) -> PromptWork:
        """Greedy, one sample, at the learner's version."""
        greedy = self.sampling.model_copy(update={"temperature": 0.0, "top_p": 1.0, "top_k": -1})
        return PromptWork(
            run_id=self.cfg.run.id,
            prompt_id=prompt_id,
            index=index,
            step=step,
            min_policy_version=version,
            prompt_ids=self._prompt_ids(prompt),
            prompt_text=prompt,
            meta=meta,
            n=1,
            sampling=greedy,
            split="val",
        )
