"""`model.path` as verl users give it: a checkpoint dir, or a hub id resolved through huggingface_hub's
cache (a cache laid out like the hub's, built here: nothing is downloaded)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from rlbus.model_source import resolve_model_path
from rlbus.tiny_model import ensure_default_model

RESOLVE = "from rlbus.model_source import resolve_model_path as r; import sys; print(r(sys.argv[1]))"


def _hub_cache(home: Path, repo_id: str, revision: str = "0123456789abcdef0123456789abcdef01234567") -> Path:
    """HF_HOME/hub/models--org--name/{refs/main, snapshots/<revision>/...}, as huggingface_hub writes it."""
    repo = home / "hub" / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / revision
    shutil.copytree(ensure_default_model(), snapshot)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(revision)
    return snapshot


def _resolve_offline(home: Path, model: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HOME": str(home), "HF_HUB_OFFLINE": "1"}
    env.pop("HF_HUB_CACHE", None)
    return subprocess.run([sys.executable, "-c", RESOLVE, model], env=env, capture_output=True, text=True)


def test_a_checkpoint_dir_is_used_as_it_is() -> None:
    local = ensure_default_model()
    assert resolve_model_path(local) == local
    assert resolve_model_path(None) == local


def test_a_hub_id_resolves_to_its_snapshot_in_the_hub_cache(tmp_path: Path) -> None:
    snapshot = _hub_cache(tmp_path / "hf", "acme/tiny-addition")
    proc = _resolve_offline(tmp_path / "hf", "acme/tiny-addition")
    assert proc.returncode == 0, proc.stderr
    assert Path(proc.stdout.strip()) == snapshot


def test_a_hub_id_missing_offline_names_the_key_and_the_fix(tmp_path: Path) -> None:
    _hub_cache(tmp_path / "hf", "acme/tiny-addition")
    proc = _resolve_offline(tmp_path / "hf", "acme/not-cached")
    assert proc.returncode != 0
    assert "model.path=acme/not-cached" in proc.stderr and "hf download acme/not-cached" in proc.stderr


def test_a_missing_directory_is_not_taken_for_a_hub_id(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no config.json"):
        resolve_model_path(tmp_path / "nope" / "model")


def test_use_shm_copies_once_per_checkpoint_and_loads_from_the_copy(tmp_path: Path) -> None:
    from rlbus.config import load_config
    from rlbus.modeling import load_causal_lm

    src = tmp_path / "ckpt"
    shutil.copytree(ensure_default_model(), src)
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else tmp_path
    root = Path(tempfile.mkdtemp(prefix="rlbus-test-shm-", dir=shm))
    try:
        cfg = load_config(
            None, [f"actor_rollout_ref.model.path={src}", "actor_rollout_ref.model.use_shm=True"]
        )
        assert cfg.model.use_shm and not cfg.inert_keys
        first = resolve_model_path(cfg.model.path, cfg.model.use_shm, shm_root=root)
        assert first.parent == root and first != src
        assert sorted(p.name for p in first.iterdir()) == sorted(p.name for p in src.iterdir())
        marker = first / "config.json"
        stamp = marker.stat().st_mtime_ns
        assert resolve_model_path(src, use_shm=True, shm_root=root) == first  # the host's copy, reused
        assert marker.stat().st_mtime_ns == stamp
        (src / "config.json").write_text((src / "config.json").read_text() + "\n")  # a changed checkpoint
        assert resolve_model_path(src, use_shm=True, shm_root=root) != first
        assert load_causal_lm(first, "float32", "cpu") is not None
        assert resolve_model_path(src) == src  # without use_shm: the directory itself
    finally:
        shutil.rmtree(root, ignore_errors=True)
