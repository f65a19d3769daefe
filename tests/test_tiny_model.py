"""The tiny model: char tokenizer, the committed asset, a quick deterministic build."""

from __future__ import annotations

import json
import time

import pytest
import torch

from rlbus.held_out import evaluate_accuracy
from rlbus.tasks import get_task
from rlbus.tiny_model import (
    CHARACTERS,
    INFO_FILE,
    build_tiny_model,
    build_tokenizer,
    default_model_path,
    ensure_default_model,
    is_model_dir,
    read_info,
)


@pytest.fixture(autouse=True)
def _few_threads():
    old = torch.get_num_threads()
    torch.set_num_threads(min(2, old))
    yield
    torch.set_num_threads(old)


def test_tokenizer_one_token_per_char_and_round_trip(tmp_path):
    from transformers import AutoTokenizer

    build_tokenizer(tmp_path)
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    ids = tok("37+45=")["input_ids"]
    assert tok.convert_ids_to_tokens(ids) == list("37+45=")
    for text in ["37+45=82", "use 3 5 7 to make 22:(3+5)*7", " a b\nc ", CHARACTERS]:
        enc = tok(text, add_special_tokens=False)["input_ids"]
        assert len(enc) == len(text)
        assert tok.decode(enc) == text
    assert tok.eos_token == "<eos>" and tok.pad_token == "<pad>" and tok.bos_token == "<bos>"
    assert len({tok.eos_token_id, tok.pad_token_id, tok.bos_token_id}) == 3
    assert tok.decode(tok("82")["input_ids"] + [tok.eos_token_id], skip_special_tokens=True) == "82"
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert cfg["tokenizer_class"] == "PreTrainedTokenizerFast"


def test_committed_asset_loads_and_is_warm():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = default_model_path()
    assert is_model_dir(path), f"committed asset missing at {path}"
    assert ensure_default_model() == path
    size = sum(f.stat().st_size for f in path.iterdir())
    assert size < 5 * 1024 * 1024
    tok = AutoTokenizer.from_pretrained(str(path))
    model = AutoModelForCausalLM.from_pretrained(str(path))
    cfg = model.config
    assert cfg.model_type == "qwen2" and cfg.hidden_size // cfg.num_attention_heads == 32
    assert cfg.head_dim == 32 and cfg.tie_word_embeddings and cfg.vocab_size == len(tok)
    assert model.generation_config.eos_token_id == tok.eos_token_id
    info = read_info(path)
    assert info["task"] == "addition" and info["digits"] == 2
    assert 0.10 <= info["val_accuracy_sampled_t1"] <= 0.50
    assert info["val_accuracy_greedy"] >= info["val_accuracy_sampled_t1"]
    # the recorded numbers are reproducible from the saved weights (a smaller slice, same seeds)
    task = get_task("addition", digits=2)
    examples = task.make_examples("val", 200, seed=info["seed"] + 1)
    greedy = evaluate_accuracy(model, tok, task, examples, temperature=0.0, max_new_tokens=4)
    sampled = evaluate_accuracy(model, tok, task, examples, temperature=1.0, max_new_tokens=4, seed=1)
    assert 0.3 <= greedy <= 0.8
    assert 0.05 <= sampled <= 0.55
    assert sampled == evaluate_accuracy(model, tok, task, examples, temperature=1.0, max_new_tokens=4, seed=1)


def test_quick_build_is_fast_and_deterministic(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = dict(sft_steps=6, eval_every=3, eval_examples=16, final_eval_examples=32, batch_size=16)
    t0 = time.monotonic()
    info = build_tiny_model(tmp_path / "a", **kwargs)
    assert time.monotonic() - t0 < 30
    assert info["sft_steps_done"] in (3, 6)
    assert is_model_dir(tmp_path / "a")
    saved = json.loads((tmp_path / "a" / INFO_FILE).read_text())
    assert saved["val_accuracy_greedy"] == info["val_accuracy_greedy"]
    assert "build_seconds" not in saved
    again = build_tiny_model(tmp_path / "b", **kwargs)
    assert again["val_accuracy_sampled_t1"] == info["val_accuracy_sampled_t1"]
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (
        tmp_path / "b" / "model.safetensors"
    ).read_bytes()
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "a"))
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "a"))
    assert model.num_parameters() < 1_000_000
    out = model(**tok(["37+45="], return_tensors="pt"))
    assert out.logits.shape == (1, 6, len(tok))


def test_countdown_build(tmp_path):
    info = build_tiny_model(
        tmp_path, task="countdown", digits=1, sft_steps=2, target_sampled_accuracy=None, final_eval_examples=8
    )
    assert info["task"] == "countdown" and info["sft_steps_done"] == 2
    assert 0.0 <= info["val_accuracy_sampled_t1"] <= 1.0


def test_ensure_default_model_builds_into_cache(tmp_path, monkeypatch):
    import rlbus.tiny_model as tm

    calls = []

    def fake_build(out_dir, **kwargs):
        calls.append(out_dir)
        return build_tiny_model(out_dir, sft_steps=1, final_eval_examples=4, target_sampled_accuracy=None)

    monkeypatch.setattr(tm, "default_model_path", lambda: tmp_path / "missing")
    monkeypatch.setattr(tm, "build_tiny_model", fake_build)
    monkeypatch.setenv("RLBUS_CACHE_DIR", str(tmp_path / "cache"))
    path = tm.ensure_default_model()
    assert path == tmp_path / "cache" / "tiny-addition" and is_model_dir(path)
    assert tm.ensure_default_model() == path and len(calls) == 1
    assert [p.name for p in (tmp_path / "cache").iterdir()] == ["tiny-addition"]


def test_cli_hook(tmp_path, capsys):
    from rlbus.cli_tiny import make_tiny_model_command

    rc = make_tiny_model_command([str(tmp_path / "m"), "--sft-steps", "2", "--digits", "1", "--quiet"])
    assert rc == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["digits"] == 1 and summary["sft_steps_done"] <= 2
    assert is_model_dir(tmp_path / "m")
