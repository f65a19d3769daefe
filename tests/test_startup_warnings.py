"""Start-up warnings are about keys the user set: under `rlbus up` the services load the keys that were set
(config.set.yaml), not the fully resolved config.yaml, in which every key would count as the user's and a
plain run warned about five keys nobody set ("total_training_steps=150 (set by you)")."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from e2e_utils import rlbus_up


@pytest.mark.timeout(180)
def test_a_run_warns_only_about_the_keys_its_user_set(tmp_path: Path, nats_url: str, run_id: str) -> None:
    done = rlbus_up(
        tmp_path, nats_url, run_id, "trainer.total_training_steps=2", "data.val_batch_size=8", timeout=170
    )
    assert done.returncode == 0, done.stderr[-3000:]
    run_dir = tmp_path / "runs" / run_id
    logs = "".join(p.read_text() for p in (run_dir / "logs").glob("*.log"))
    warned = re.findall(r"detail='([a-z_]+\.[a-z_.]+)", logs) + re.findall(
        r'detail="([a-z_]+\.[a-z_.]+)', logs
    )
    assert warned == ["data.val_batch_size"], warned
    services_config = yaml.safe_load((run_dir / "config.set.yaml").read_text())
    assert services_config["data"] == {"val_batch_size": 8} and services_config["bus"]["url"] == nats_url
    assert "critic" not in services_config  # nobody set it
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["critic"]  # the full record is kept
