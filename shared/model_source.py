"""Where a service's model comes from: a checkpoint dir, a Hugging Face hub id, or the bundled tiny model."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
from pathlib import Path

_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


SHM_ROOT = Path("/dev/shm/rlbus-models")


def resolve_model_path(path: Path | str | None, use_shm: bool = False, shm_root: Path | None = None) -> Path:
    """`model.path` as a local directory. A hub id ("Qwen/Qwen2.5-0.5B-Instruct", as verl's configs give
    it) that is not a local directory resolves through huggingface_hub's cache, so `HF_HOME`,
    `HF_HUB_CACHE` and `HF_HUB_OFFLINE` mean what they mean to transformers (offline: the cache only).
    `use_shm` (verl's `model.use_shm`): the directory is copied to /dev/shm once per host and loaded
    from there."""
    local = _local_model_path(path)
    return copy_to_shm(local, shm_root or SHM_ROOT) if use_shm else local


def copy_to_shm(src: Path, root: Path = SHM_ROOT) -> Path:
    """`src` copied under `root` (a tmpfs), once per host: every service of a host that asks for the same
    checkpoint (same path, file sizes and times) gets the same copy. The copy is made in a temporary
    directory and renamed into place, so a reader never sees a half-written model."""
    stats = {f: f.stat() for f in sorted(p for p in src.rglob("*") if p.is_file())}
    digest = hashlib.sha256(str(src.resolve()).encode())
    for f, st in stats.items():
        digest.update(f"{f.relative_to(src)}:{st.st_size}:{st.st_mtime_ns}".encode())
    dest = root / f"{src.name}-{digest.hexdigest()[:16]}"
    if (dest / "config.json").is_file():
        return dest
    root.mkdir(parents=True, exist_ok=True)
    need = sum(st.st_size for st in stats.values())
    free = shutil.disk_usage(root).free
    if need > free:
        raise OSError(f"model.use_shm: {src} needs {need / 1e9:.1f} GB in {root}, {free / 1e9:.1f} GB free")
    staging = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=root))
    try:
        shutil.copytree(src, staging, dirs_exist_ok=True)
        os.rename(staging, dest)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
        if not (dest / "config.json").is_file():  # another service of this host won the race: use its copy
            raise
    return dest


def _local_model_path(path: Path | str | None) -> Path:
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
