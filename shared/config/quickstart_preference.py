"""The users' quick start's preference YAML (`algorithm: dpo` at the top, with `train_batch_size`, `seq_len`,
`gradient_accumulation_steps`, `model:` and verl's `actor_rollout_ref:` sections) as our keys, so the file
means one thing through `python scripts/train_dpo.py --config` and `rlbus train --config` alike.

Every key maps onto ours with its documented meaning, or is reported as having no effect here (with the
reason, printed at start), or is refused when honouring it here would mean something else. Pure: the
file's mapping in, (our flat keys, inert keys) out.
"""

from __future__ import annotations

from typing import Any

PREFERENCE_ALGORITHMS = ("dpo", "kto", "simpo")

# the quick start's key -> ours (same meaning and units)
DIRECT: dict[str, str] = {
    "algorithm": "preference.algorithm",
    "train_batch_size": "preference.batch_size",  # pairs per optimizer step
    "seq_len": "preference.max_length",  # prompt + completion tokens
    "model.path": "model.path",
    "model.enable_gradient_checkpointing": "model.enable_gradient_checkpointing",
    "model.use_remove_padding": "model.use_remove_padding",
    "actor_rollout_ref.actor.fsdp_config.param_offload": "actor.param_offload",
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload": "actor.optimizer_offload",
    "actor_rollout_ref.actor.optim_config.lr": "preference.lr",
    "actor_rollout_ref.actor.optim_config.weight_decay": "preference.weight_decay",
}

# keys (or prefixes ending in '.') that change nothing here -> why
INERT: dict[str, str] = {
    "actor_rollout_ref.actor.fsdp_config.wrap_policy.": "FSDP2 shards every decoder layer of the model, "
    "whatever layer class or size is named",
    "actor_rollout_ref.rollout.": "offline preference training generates nothing: the pairs are the data",
    "actor_rollout_ref.ref.fsdp_config.param_offload": "reference log-probs are computed once, before the "
    "policy loads, and the reference model is freed",
}


def is_quickstart_preference(raw: dict[str, Any]) -> bool:
    """A file in the quick start's shape: `algorithm` is a preference algorithm's name, not a section."""
    return isinstance(raw.get("algorithm"), str) and raw["algorithm"].strip().lower() in PREFERENCE_ALGORITHMS


def quickstart_keys(flat: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """The file's flattened keys as (our flat dotted keys, {its key: why it has no effect}); ValueError names
    a key whose value would mean something else here. Keys it does not know pass through, checked as ours."""
    flat = dict(flat)
    out: dict[str, Any] = {}
    inert: dict[str, str] = {}
    accumulation = flat.pop("gradient_accumulation_steps", None)
    for key, value in flat.items():
        why = next((w for k, w in INERT.items() if key == k or (k.endswith(".") and key.startswith(k))), None)
        if why is not None:
            inert[key] = why
        elif key in DIRECT:
            out[DIRECT[key]] = value.strip().lower() if key == "algorithm" else value
        elif key == "actor_rollout_ref.actor.fsdp_config.fsdp_size":
            if int(value) != -1:
                raise ValueError(
                    f"{key}={value}: rlbus shards over every learner rank (-1); groups of another size are not supported"
                )
        elif key == "actor_rollout_ref.actor.optim_config.name":
            if str(value).lower() != "adamw":
                raise ValueError(f"{key}={value}: the preference trainer's optimizer is AdamW")
        else:
            out[key] = value
    if accumulation is not None:
        batch = int(out.get("preference.batch_size", 16))
        steps = int(accumulation)
        if steps < 1 or batch % steps:
            raise ValueError(
                f"gradient_accumulation_steps={steps} must divide train_batch_size={batch} "
                "(pairs per optimizer step = micro-batch x accumulation steps)"
            )
        out["preference.micro_batch_size"] = batch // steps
    return out, inert
