"""TRL's side of the learning benchmark (`learning.py`): GRPOTrainer on the same model, data, reward and
budget, in a child process of its own (`python learning_trl.py SPEC`), so the GPU is free again after it."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path


def static_cache_in_autocast_dtype() -> None:
    """Under bf16 autocast with fp32 weights, rotary embedding leaves keys in fp32 while values come out of the
    projection in bf16; transformers' static cache takes its dtype from the keys, so the values' copy into it
    fails (index_copy_: Float and BFloat16). Cast both to the autocast dtype first: a bf16 cache, as rlbus's
    engine keeps."""
    import torch
    from transformers.cache_utils import StaticLayer

    update = StaticLayer.update

    def update_in_autocast_dtype(self, key_states, value_states, *args, **kwargs):
        if torch.is_autocast_enabled(key_states.device.type):
            dtype = torch.get_autocast_dtype(key_states.device.type)
            key_states, value_states = key_states.to(dtype), value_states.to(dtype)
        return update(self, key_states, value_states, *args, **kwargs)

    StaticLayer.update = update_in_autocast_dtype


def trl_child(spec: dict) -> None:
    """GRPOTrainer in a process of its own (the GPU is free again after it), held-out greedy accuracy by a
    callback every `test_freq` steps, evaluation time taken off the clock."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    from worked_addition import DATA_SOURCE, WorkedAddition, compute_score, rendered

    from rlbus.held_out import evaluate_accuracy
    from rlbus.modeling import load_tokenizer

    # as rlbus loads it: AutoTokenizer would pick Qwen2's class for this config and drop spaces and newlines
    tokenizer = load_tokenizer(spec["model"])
    task = WorkedAddition(spec["min_digits"], spec["max_digits"])
    val = rendered(tokenizer, task.make_examples("val", spec["val_examples"], seed=spec["seed"]))
    points: list[tuple[float, float]] = []
    updates: list[int] = []  # optimizer steps behind each point
    eval_s = [0.0]

    def correct(completions, ground_truth, **_kw):
        return [
            compute_score(DATA_SOURCE, c[-1]["content"], gt)
            for c, gt in zip(completions, ground_truth, strict=True)
        ]

    class HeldOut(TrainerCallback):
        def evaluate(self, model, update: int) -> None:
            t0 = time.time()
            updates.append(update)
            acc = evaluate_accuracy(
                model, tokenizer, task, val, temperature=0.0, max_new_tokens=spec["max_new_tokens"]
            )
            points.append((t0 - spec["launched"] - eval_s[0], acc))  # the clock without earlier evaluations
            eval_s[0] += time.time() - t0

        def on_train_begin(self, _args, state, control, model=None, **_kw):
            self.evaluate(model, state.global_step)

        def on_step_end(self, _args, state, control, model=None, **_kw):
            spent = time.time() - spec["launched"] - eval_s[0]
            if state.global_step % spec["test_freq"] == 0 or spent >= spec["budget_s"]:
                self.evaluate(model, state.global_step)
            control.should_training_stop = spent >= spec["budget_s"]

    config = GRPOConfig(
        output_dir=spec["out"], per_device_train_batch_size=spec["micro_batch"],
        gradient_accumulation_steps=spec["prompts"] * spec["n"] // spec["micro_batch"], num_generations=spec["n"],
        max_completion_length=spec["max_new_tokens"], learning_rate=spec["lr"], beta=0.0, temperature=spec["temperature"],
        max_steps=100000, logging_steps=1, report_to="none", save_strategy="no", bf16=spec["dtype"] == "bfloat16",
        tf32=spec["device"] == "cuda" and spec["trl_precision"] == "mixed",
        use_cpu=spec["device"] == "cpu", cache_implementation="static" if spec["device"] == "cuda" else None,
        gradient_checkpointing=False, seed=0, dataloader_num_workers=0,
    )  # fmt: skip
    import pyarrow.parquet as pq

    rows = pq.read_table(spec["train"]).to_pylist()
    dataset = Dataset.from_dict({"prompt": [r["prompt"] for r in rows],
                                 "ground_truth": [r["reward_model"]["ground_truth"] for r in rows]})  # fmt: skip
    # mixed: fp32 weights, bf16 autocast (HF Trainer's mixed precision), so AdamW updates the fp32 weights as
    # rlbus's optimizer updates its fp32 master copy; bf16: the weights themselves in bf16, where an update
    # under bf16's resolution (about 0.4% of a weight) is rounded away
    pure_bf16 = spec["dtype"] == "bfloat16" and spec["trl_precision"] == "bf16"
    dtype = torch.bfloat16 if pure_bf16 else torch.float32
    if spec["dtype"] == "bfloat16" and not pure_bf16:
        static_cache_in_autocast_dtype()
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=dtype)
    trainer = GRPOTrainer(model=model, reward_funcs=correct, args=config, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[HeldOut()])  # fmt: skip
    if spec["device"] == "cuda":
        # the compiled static-cache decode that rlbus's engine uses
        trainer.generation_config.disable_compile = False
    trainer.train()
    Path(spec["result"]).write_text(
        json.dumps({"points": points, "steps": trainer.state.global_step, "updates": updates})
    )


def run_trl(
    args: argparse.Namespace, model: Path, data: tuple[Path, Path], work: Path, env: dict[str, str]
) -> tuple[str, list[tuple[float, float]], int, list[int]]:
    """TRL's curve (name, (seconds, accuracy) points, steps, updates behind each point), from a child process
    launched with `env`."""
    out = work / "trl"
    spec = {
        "out": str(out), "result": str(out / "result.json"), "model": str(model), "train": str(data[0]),
        "min_digits": args.min_digits, "max_digits": args.max_digits, "val_examples": args.val_examples,
        "seed": args.seed, "prompts": args.prompts, "n": args.n, "micro_batch": args.micro_batch,
        "max_new_tokens": args.max_new_tokens, "lr": args.lr, "temperature": args.temperature, "dtype": args.dtype, "device": args.device,
        "trl_precision": args.trl_precision,
        "test_freq": args.test_freq, "budget_s": args.budget_s, "launched": time.time(),
    }  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    decode = "static cache, compiled decode" if args.device == "cuda" else "its default decode"
    precision = f"{args.trl_precision} precision" if args.dtype == "bfloat16" else "float32"
    print(f"TRL GRPOTrainer ({decode}, gradient checkpointing off, {precision})", flush=True)
    done = subprocess.run([sys.executable, __file__, json.dumps(spec)], cwd=work, env=env, capture_output=True,
                          text=True, timeout=args.budget_s + 600)  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"TRL exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    result = json.loads(Path(spec["result"]).read_text())
    name = "TRL GRPOTrainer" + (" (bf16 weights)" if args.trl_precision == "bf16" else "")
    points = [(float(t), float(acc)) for t, acc in result["points"]]
    return name, points, int(result["steps"]), [int(u) for u in result.get("updates", [])]


if __name__ == "__main__":
    trl_child(json.loads(sys.argv[1]))
