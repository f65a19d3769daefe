"""Turns ready trajectory groups into the padded tensors one update trains on."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from rlbus.messages import ReadyGroup
from rlbus.modeling import pad_batch


@dataclass
class TrainBatch:
    """Samples of several groups, right-padded. Token tensors are [B, L-1]: position t predicts token t+1."""

    input_ids: torch.Tensor  # [B, L]
    attention_mask: torch.Tensor  # [B, L]
    position_ids: torch.Tensor  # [B, L]
    response_mask: torch.Tensor  # [B, L-1] float, 1 where the predicted token is a response token
    behaviour_logprobs: torch.Tensor  # [B, L-1], 0 off-response
    ref_logprobs: torch.Tensor | None  # [B, L-1]
    rewards: torch.Tensor  # [B]
    correct: torch.Tensor  # [B] bool
    group_ids: torch.Tensor  # [B] long
    policy_versions: torch.Tensor  # [B] long
    temperature: float

    @property
    def size(self) -> int:
        return int(self.input_ids.shape[0])

    def select(self, idx: torch.Tensor | Sequence[int]) -> TrainBatch:
        """The rows ``idx``. A run of consecutive rows (the usual micro-batch) is a view, not a gather: the
        gathers were a third of the host's time in a learner step on a busy H200 host; other rows are
        gathered by numpy (torch's CPU gathers wait on its thread pool: 1.9 ms each in a profiled step)."""
        rows = row_index(idx)

        def take(t: torch.Tensor) -> torch.Tensor:
            if isinstance(rows, slice) or t.device.type != "cpu" or t.dtype == torch.bfloat16:
                return t[rows]
            return torch.from_numpy(t.numpy()[rows.numpy()])

        return TrainBatch(
            input_ids=take(self.input_ids),
            attention_mask=take(self.attention_mask),
            position_ids=take(self.position_ids),
            response_mask=take(self.response_mask),
            behaviour_logprobs=take(self.behaviour_logprobs),
            ref_logprobs=None if self.ref_logprobs is None else take(self.ref_logprobs),
            rewards=take(self.rewards),
            correct=take(self.correct),
            group_ids=take(self.group_ids),
            policy_versions=take(self.policy_versions),
            temperature=self.temperature,
        )


def row_index(idx: torch.Tensor | Sequence[int]) -> torch.Tensor | slice:
    """``idx`` as an index: a slice when the rows are consecutive (a view instead of a gather)."""
    rows = np.asarray(idx.cpu() if isinstance(idx, torch.Tensor) else list(idx), dtype=np.int64).reshape(-1)
    if rows.size and np.array_equal(rows, np.arange(rows[0], rows[0] + rows.size)):
        return slice(int(rows[0]), int(rows[0]) + rows.size)
    return torch.from_numpy(rows)


def collate(groups: list[ReadyGroup], pad_id: int) -> TrainBatch:
    prompts: list[Sequence[int]] = []
    responses: list[Sequence[int]] = []
    behaviour: list[np.ndarray] = []
    refs: list[np.ndarray] = []
    rewards: list[float] = []
    correct: list[bool] = []
    group_ids: list[int] = []
    versions: list[int] = []
    temperature = 1.0
    for gid, group in enumerate(groups):
        traj = group.scored.trajectories
        temperature = traj.work.sampling.temperature or 1.0
        for i, sample in enumerate(traj.samples):
            prompts.append(traj.work.prompt_ids)
            responses.append(sample.response_ids)
            behaviour.append(np.asarray(sample.logprobs, dtype=np.float32))
            if group.ref_logprobs is not None:
                refs.append(np.asarray(group.ref_logprobs[i], dtype=np.float32))
            rewards.append(float(group.scored.rewards[i]))
            correct.append(bool(group.scored.correct[i]))
            group_ids.append(gid)
            versions.append(traj.policy_version)

    # the one padding rule the engines' log-prob recompute uses: right padded, positions from the mask
    input_ids, attention, position_ids, resp_mask_long = pad_batch(prompts, responses, pad_id)
    resp_mask = resp_mask_long.float()
    bsz, width = resp_mask.shape
    beh = np.zeros((bsz, width), dtype=np.float32)
    # reference rows only when every row has one (a KL term needs them, and admission then demands them)
    ref = np.zeros((bsz, width), dtype=np.float32) if refs and len(refs) == bsz else None
    for b, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        start, end = len(p) - 1, len(p) - 1 + len(r)  # logits at t predict token t+1
        beh[b, start:end] = behaviour[b][: len(r)]
        if ref is not None:
            ref[b, start:end] = refs[b][: len(r)]
    return TrainBatch(
        input_ids=input_ids,
        attention_mask=attention,
        position_ids=position_ids,
        response_mask=resp_mask,
        behaviour_logprobs=torch.from_numpy(beh),
        ref_logprobs=torch.from_numpy(ref) if ref is not None else None,
        rewards=torch.tensor(rewards, dtype=torch.float32),
        correct=torch.tensor(correct, dtype=torch.bool),
        group_ids=torch.tensor(group_ids, dtype=torch.long),
        policy_versions=torch.tensor(versions, dtype=torch.long),
        temperature=temperature,
    )


def placeholder_batch(rows: int, width: int, temperature: float, padded: bool = True) -> TrainBatch:
    """`rows` sequences of up to `width` tokens (token id 1, the second half a response) for warming up
    compiled layers: two or more rows and tokens, since torch specializes sizes 0 and 1 into graphs of their
    own. `padded`: the last row shorter, as in most real batches; not: rows of one length, which take other
    graphs (padded rows without padding reach the layers with no mask at all, and a packed learner runs
    equal rows dense), so a warm-up compiles both."""
    rows, width = max(2, rows), max(8, width)
    attention = torch.ones((rows, width), dtype=torch.long)
    if padded:
        attention[-1, -width // 4 :] = 0
    response = torch.zeros((rows, width - 1))
    response[:, width // 2 :] = 1.0
    response *= attention[:, 1:]
    return TrainBatch(
        input_ids=torch.ones((rows, width), dtype=torch.long) * attention,
        attention_mask=attention,
        position_ids=torch.arange(width).expand(rows, width).clone(),
        response_mask=response,
        behaviour_logprobs=torch.zeros((rows, width - 1)),
        ref_logprobs=None,
        rewards=torch.zeros(rows),
        correct=torch.zeros(rows, dtype=torch.bool),
        group_ids=torch.zeros(rows, dtype=torch.long),
        policy_versions=torch.zeros(rows, dtype=torch.long),
        temperature=temperature,
    )
