"""Hugging Face exports: a checkpoint (DCP) to a safetensors directory, and the learner's final weights.

The output is a plain transformers directory (config.json, generation_config.json, tokenizer files,
*.safetensors) that `AutoModelForCausalLM.from_pretrained`, vLLM and SGLang load as they are.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from rlbus.learner.checkpoint import (
    CheckpointError,
    _barrier,
    _rank,
    _save_hf_files,
    hf_module,
    load_model_state,
    resolve_checkpoint,
)

_NOT_TOKENIZER = {"config.json", "generation_config.json"}


def _write_dir_atomically(out: Path, write) -> Path:
    """Writes into `out.tmp/` with `write(tmp)`, then renames it to `out` (which must not hold anything)."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} exists and is not empty; choose a new directory")
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        write(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out.exists():
        out.rmdir()
    tmp.rename(out)
    return out


def export_hf(
    checkpoint_dir: str | os.PathLike, out_dir: str | os.PathLike, dtype: str | None = None
) -> Path:
    """A Hugging Face safetensors directory from a learner checkpoint (a step dir, or the latest under a
    checkpoints root / run dir). Runs in one process whatever wrote the checkpoint (DCP reshards)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    ckpt = resolve_checkpoint(checkpoint_dir)
    hf_dir = ckpt / "hf"
    if not (hf_dir / "config.json").is_file():
        raise CheckpointError(f"{ckpt} has no hf/config.json: it cannot be exported")
    state = load_model_state(ckpt)
    if dtype is not None:
        from rlbus.modeling import torch_dtype

        state = {k: v.to(torch_dtype(dtype)) for k, v in state.items()}
    config = AutoConfig.from_pretrained(hf_dir)

    def write(tmp: Path) -> None:
        with torch.device("meta"):  # a vehicle for the class and config: the tensors come from `state`
            model = AutoModelForCausalLM.from_config(config)
        missing = set(model.state_dict()) - set(state)
        tied = _tied_keys(model)
        if missing - tied:
            raise CheckpointError(
                f"{ckpt}: checkpoint lacks weights {sorted(missing - tied)[:5]} of {config.model_type}"
            )
        model.save_pretrained(tmp, state_dict=state, safe_serialization=True)
        for f in hf_dir.iterdir():  # tokenizer, and the generation config saved from training
            if f.is_file() and (f.name not in _NOT_TOKENIZER or f.name == "generation_config.json"):
                shutil.copy2(f, tmp / f.name)

    return _write_dir_atomically(Path(out_dir), write)


def _tied_keys(model: torch.nn.Module) -> set[str]:
    keys = getattr(model, "_tied_weights_keys", None) or {}
    names = set(keys) if isinstance(keys, dict | list | tuple | set) else set()
    if getattr(getattr(model, "config", None), "tie_word_embeddings", False):
        names.add("lm_head.weight")
    return names


def full_model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Full (unsharded) CPU weights of a plain, DDP or FSDP2 module; under torch.distributed, a collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    dist_on = torch.distributed.is_available() and torch.distributed.is_initialized()
    opts = StateDictOptions(full_state_dict=dist_on, cpu_offload=dist_on)
    state = get_model_state_dict(model, options=opts)
    return {k: v.detach().to("cpu") for k, v in state.items() if isinstance(v, torch.Tensor)}


def save_hf(model: torch.nn.Module, tokenizer: Any, out_dir: str | os.PathLike) -> Path:
    """The model as it is now, as a Hugging Face directory (the learner's `<run_dir>/final/`).

    Replaces an earlier export at `out_dir`. Every rank calls it; rank 0 writes.
    """
    from rlbus.learner.model import full_state_items, is_lora

    out = Path(out_dir)
    lora = is_lora(model)
    # LoRA: write the merged weights under the base names, a model any engine loads (not just the adapter)
    state = {k: v.detach().to("cpu") for k, v in full_state_items(model)} if lora else full_model_state(model)
    hf: Any = hf_module(model)
    target = hf.get_base_model() if lora else hf
    # Gathered shards are separate tensors, so save_pretrained cannot see that tied weights are one:
    # drop the tied copies as a one-process save does (the config ties them again on load).
    state = {k: v for k, v in state.items() if k not in _tied_keys(target)}
    if _rank() == 0:
        old = out.with_name(out.name + ".old")
        if out.exists():
            shutil.rmtree(old, ignore_errors=True)
            out.rename(old)

        def write(tmp: Path) -> None:
            _save_hf_files(model, tokenizer, tmp)
            target.save_pretrained(tmp, state_dict=state)

        _write_dir_atomically(out, write)
        with contextlib.suppress(OSError):
            shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return out
