"""`model.path` as verl users give it: a checkpoint dir, or a hub id resolved through huggingface_hub's
cache (a cache laid out like the hub's, built here: nothing is downloaded)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
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
