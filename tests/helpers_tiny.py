"""A tiny random Qwen2 model + character-level tokenizer, built locally (no downloads) for engine tests."""

from __future__ import annotations

from pathlib import Path

import torch

CHARS = list("0123456789+-*=? abcdefghij\n.")
SPECIALS = ["<pad>", "<eos>", "<bos>"]


def build_tokenizer(out_dir: Path):
    """Character-level WordLevel tokenizer saved as PreTrainedTokenizerFast (decode joins chars with no spaces)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + CHARS)}
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tk.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>"
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out_dir))
    return fast


def build_tiny_model(out_dir: Path, seed: int = 0, tie: bool = True) -> Path:
    """Random 2-layer Qwen2 (hidden 64, 2 heads of head_dim 32) + tokenizer in `out_dir`."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tok = build_tokenizer(out_dir)
    cfg = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=256,
        tie_word_embeddings=tie,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.bos_token_id,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg)
    with torch.no_grad():  # larger-than-init weights so distributions are far from uniform
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.2)
    model.save_pretrained(str(out_dir))
    return out_dir


def perturbed_model(model_dir: Path, seed: int, scale: float = 0.05):
    """The tiny model with deterministic noise added in place (ties kept): a stand-in for a trained step."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale)
    model.eval()
    return model


def push_weights_process(model_dir: str, seed: int, port: int, bucket_bytes: int, plans, done) -> None:
    """Learner stand-in (run in its own process): pushes the perturbed weights twice over one gloo group.

    Push 1 sends named_parameters (no tied lm_head), push 2 the whole state_dict (lm_head included).
    Each plan is put on `plans` before the push so the test can announce it to the engine.
    """
    torch.set_num_threads(1)
    from rlbus.weight_sync import WeightSender

    model = perturbed_model(Path(model_dir), seed)
    sender = WeightSender(backend="gloo", host="127.0.0.1", timeout_s=30.0, bucket_bytes=bucket_bytes)
    pushes = [list(model.named_parameters()), list(model.state_dict().items())]
    try:
        for i, named in enumerate(pushes):
            plan = sender.plan(named)
            plans.put(plan.announcement_fields())
            if i == 0:
                sender.open(port, world_size=2, epoch=0)
            sender.send(named, plan)
        done.put("ok")
    except Exception as exc:  # noqa: BLE001 - reported to the test
        done.put(f"error: {exc!r}")
    finally:
        sender.close()
