"""Where a service's model comes from: a checkpoint dir, a Hugging Face hub id, or the bundled tiny model."""

from __future__ import annotations

import re
from pathlib import Path

_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


def resolve_model_path(path: Path | str | None) -> Path:
    """`model.path` as a local directory. A hub id ("Qwen/Qwen2.5-0.5B-Instruct", as verl's configs give
    it) that is not a local directory resolves through huggingface_hub's cache, so `HF_HOME`,
    `HF_HUB_CACHE` and `HF_HUB_OFFLINE` mean what they mean to transformers (offline: the cache only)."""
    if path is None:
        from rlbus.tiny_model import ensure_default_model

        return ensure_default_model()
    resolved = Path(path).expanduser()
    if (resolved / "config.json").is_file():
        return resolved
    if not resolved.exists() and _HUB_ID.fullmatch(str(path)):
        return _from_hub(str(path))
    raise FileNotFoundError(f"model.path={resolved} is not a Hugging Face checkpoint dir (no config.json)")


def _from_hub(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    try:
        snapshot = Path(snapshot_download(repo_id))
    except Exception as exc:  # offline without a cached copy, unknown repo, no network
        raise FileNotFoundError(
            f"model.path={repo_id}: not a local directory, and the Hugging Face hub gave no copy "
            f"({type(exc).__name__}: {exc}). Download it first (`hf download {repo_id}`), point HF_HOME "
            "at a cache that holds it, or give a checkpoint directory."
        ) from exc
    if not (snapshot / "config.json").is_file():
        raise FileNotFoundError(f"model.path={repo_id}: the hub snapshot {snapshot} has no config.json")
    return snapshot
