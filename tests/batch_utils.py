"""Learner-side messages built by hand for unit tests: one scored group, as the reward service sends it."""

from __future__ import annotations

import numpy as np

from rlbus.messages import PromptWork, ReadyGroup, Sample, SamplingParams, ScoredGroup, TrajectoryGroup


def ready_group(
    prompt: list[int],
    responses: list[list[int]],
    rewards: list[float],
    version: int = 0,
    logprob: float = -1.0,
) -> ReadyGroup:
    """A group of `responses` to `prompt`, generated at policy `version` with every behaviour log-prob
    `logprob`, scored `rewards` (correct = reward > 0)."""
    work = PromptWork(
        run_id="r",
        prompt_id=f"p{prompt}",
        index=0,
        step=0,
        min_policy_version=0,
        prompt_ids=prompt,
        n=len(responses),
        sampling=SamplingParams(),
    )
    samples = [Sample(response_ids=r, logprobs=np.full(len(r), logprob, dtype=np.float32)) for r in responses]
    traj = TrajectoryGroup(work=work, samples=samples, policy_version=version, replica_id="x", engine="hf")
    return ReadyGroup(
        scored=ScoredGroup(trajectories=traj, rewards=rewards, correct=[r > 0 for r in rewards])
    )
