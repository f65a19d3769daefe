"""`trainer.rollout_data_dir` (verl's key): every trained sample of a step written to `<dir>/<step>.jsonl`.

verl writes `input`, `output`, `gts`, `score` and `step` per sample; the same keys are here, so a user's
inspection scripts keep working, plus what an off-policy run needs to be audited: which group (`uid`) and
policy version a sample came from, the engine that made it, its token ids and behaviour log-probs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rlbus.messages import ReadyGroup


def sample_records(groups: list[ReadyGroup], step: int) -> list[dict[str, Any]]:
    """One JSON-ready record per sample, groups in the order given."""
    records = []
    for group in groups:
        traj = group.scored.trajectories
        work = traj.work
        ground_truth = work.meta.get("ground_truth", work.meta.get("answer"))
        for i, sample in enumerate(traj.samples):
            records.append(
                {
                    "input": work.prompt_text,
                    "output": sample.text,
                    "gts": ground_truth,
                    "score": group.scored.rewards[i],
                    "step": step,
                    "uid": work.prompt_id,
                    "index": work.index,
                    "data_source": work.meta.get("data_source"),
                    "extra_info": work.meta.get("extra_info"),
                    "correct": group.scored.correct[i] if i < len(group.scored.correct) else None,
                    "reward_impl": group.scored.reward_impl,
                    "policy_version": traj.policy_version,
                    "engine": traj.engine,
                    "replica_id": traj.replica_id,
                    "temperature": work.sampling.temperature,
                    "finish_reason": sample.finish_reason,
                    "prompt_ids": list(work.prompt_ids),
                    "response_ids": list(sample.response_ids),
                    "logprobs": [float(x) for x in sample.logprobs],
                }
            )
    return records


def write_rollout_data(directory: str | Path, step: int, groups: list[ReadyGroup]) -> Path:
    """Write `<directory>/<step>.jsonl` (1-based step, as in verl and in metrics.jsonl) and return its path."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{step}.jsonl"
    lines = (json.dumps(r, ensure_ascii=False, default=str) for r in sample_records(groups, step))
    path.write_text("".join(line + "\n" for line in lines))
    return path


def read_rollout_data(path: str | Path) -> list[dict[str, Any]]:
    """The records of one `<step>.jsonl`, for scripts and tests."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line]
