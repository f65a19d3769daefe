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
        gathers were a third of the host's time in a learner step on a busy H200 host."""
        idx_t = row_index(idx)
        return TrainBatch(
            input_ids=self.input_ids[idx_t],
            attention_mask=self.attention_mask[idx_t],
            position_ids=self.position_ids[idx_t],
            response_mask=self.response_mask[idx_t],
            behaviour_logprobs=self.behaviour_logprobs[idx_t],
            ref_logprobs=None if self.ref_logprobs is None else self.ref_logprobs[idx_t],
            rewards=self.rewards[idx_t],
            correct=self.correct[idx_t],
            group_ids=self.group_ids[idx_t],
            policy_versions=self.policy_versions[idx_t],
            temperature=self.temperature,
        )


def row_index(idx: torch.Tensor | Sequence[int]) -> torch.Tensor | slice:
    """``idx`` as an index: a slice when the rows are consecutive (a view instead of a gather)."""
    idx_t = torch.as_tensor(idx, dtype=torch.long)
    n = int(idx_t.numel())
    if n and bool((idx_t == torch.arange(int(idx_t[0]), int(idx_t[0]) + n)).all()):
        return slice(int(idx_t[0]), int(idx_t[0]) + n)
    return idx_t


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
    ref = np.zeros((bsz, width), dtype=np.float32) if refs else None
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
