"""TRL's DPO YAML (`trl dpo --config dpo.yaml`: DPOConfig, ModelConfig and ScriptArguments keys) as our
dotted overrides, so a DPO recipe written for TRL runs on rlbus's preference trainer unchanged.

Each TRL key maps onto one of ours with TRL's meaning, or is reported as having no effect here (returned
with the reason, printed as a warning), or is refused when running it here would mean something else.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

# TRL key -> our dotted key (same meaning, same units)
DIRECT: dict[str, str] = {
    "model_name_or_path": "model.path",
    "beta": "preference.beta",
    "learning_rate": "preference.lr",
    "num_train_epochs": "preference.epochs",
    "per_device_eval_batch_size": "preference.eval_batch_size",
    "max_length": "preference.max_length",
    "max_prompt_length": "preference.max_prompt_length",
    "warmup_steps": "preference.lr_warmup_steps",
    "weight_decay": "preference.weight_decay",
    "max_grad_norm": "preference.grad_clip",
    "label_smoothing": "preference.label_smoothing",
    "logging_steps": "preference.log_every",
    "eval_steps": "trainer.test_freq",
    "seed": "preference.seed",
    "trust_remote_code": "model.trust_remote_code",
    "gradient_checkpointing": "model.enable_gradient_checkpointing",
    "lora_r": "model.lora_rank",
    "lora_alpha": "model.lora_alpha",
    "lora_target_modules": "model.target_modules",
}

LOSS_TYPES = ("sigmoid", "ipo", "hinge")  # TRL's names for the variants rlbus has, spelled the same

# TRL keys that change nothing here -> why
INERT: dict[str, str] = {
    "logging_strategy": "metrics are logged every preference.log_every steps",
    "eval_strategy": "held-out evaluation runs every trainer.test_freq steps, before and after training",
    "save_strategy": "the final model is saved (preference.save_model)",
    "save_steps": "the final model is saved (preference.save_model)",
    "save_total_limit": "the final model is saved (preference.save_model)",
    "push_to_hub": "nothing is uploaded",
    "hub_model_id": "nothing is uploaded",
    "dataloader_num_workers": "data is read once at start",
    "torch_dtype": "use model.dtype",
    "dtype": "use model.dtype",
    "attn_implementation": "the trainer picks sdpa",
    "lr_scheduler_type": "the preference trainer warms up linearly, then holds the rate",
    "use_peft": "LoRA follows lora_r",
    "lora_dropout": "adapters train without dropout",
    "lora_task_type": "adapters are causal-LM adapters",
    "dataset_train_split": "the local file is the train split",
    "dataset_test_split": "without a test file, preference.eval_fraction of the rows are held out",
    "precompute_ref_log_probs": "reference log-probs are computed beside each batch",
    "report_to": "use trainer.logger",
    "run_name": "the run is named after output_dir",
}


def trl_dpo_overrides(doc: dict[str, Any]) -> tuple[list[str], dict[str, str]]:
    """(our dotted overrides, {TRL key: why it has no effect}) for a TRL DPO YAML. ValueError names a key
    whose value means something we do not do."""
    out = ["preference.algorithm=dpo"]
    inert: dict[str, str] = {}
    per_device = int(doc.get("per_device_train_batch_size", 8))
    accumulation = int(doc.get("gradient_accumulation_steps", 1))
    out += [
        f"preference.micro_batch_size={per_device}",
        f"preference.batch_size={per_device * accumulation}",
    ]
    for key, value in doc.items():
        if key in ("per_device_train_batch_size", "gradient_accumulation_steps"):
            continue
        if key in DIRECT:
            if value is not None:
                out.append(f"{DIRECT[key]}={_yaml_value(value)}")
        elif key == "loss_type":
            loss = value[0] if isinstance(value, list) and len(value) == 1 else value
            if loss not in LOSS_TYPES:
                raise ValueError(f"loss_type={value!r}: rlbus's DPO has {', '.join(LOSS_TYPES)}")
            out.append(f"preference.loss_type={loss}")
        elif key == "max_steps":
            if value is not None and int(value) > 0:
                out.append(f"preference.max_steps={int(value)}")
        elif key == "dataset_name":
            out.append(f"preference.train_files=[{_local_dataset(value)}]")
        elif key == "output_dir":
            path = Path(str(value))
            out += [f"run.dir={path.parent}", f"run.id={path.name}"]
        elif key in ("bf16", "fp16"):
            if value:
                out.append(f"model.dtype={'bfloat16' if key == 'bf16' else 'float16'}")
        elif key in INERT:
            inert[key] = INERT[key]
        else:
            inert[key] = "not a key rlbus's preference trainer reads"
    return out, inert


def _yaml_value(value: Any) -> str:
    if isinstance(value, list):
        return "[" + ",".join(str(v) for v in value) + "]"
    return str(value)


def _local_dataset(name: Any) -> Path:
    path = Path(str(name)).expanduser()
    if not path.exists():
        raise ValueError(
            f"dataset_name={name}: rlbus reads a local JSONL/parquet file of prompt/chosen/rejected rows "
            "(nothing is downloaded at run time); save the dataset to a file and name that file"
        )
    return path
