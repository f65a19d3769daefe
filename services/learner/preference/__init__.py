"""Offline preference training (package: `data`, `dataset`, `reference`, `losses`, `trainer`, `main`): `rlbus train` with `preference.algorithm` set to dpo, kto or simpo.

The policy (`model.path`, or the bundled tiny model) is trained on fixed preference data against a frozen
reference (`ref.model_path`, or the policy's own initial weights). Reference log-probs are computed once,
up front, for every sequence the run will ever score (train, held-out, KTO's mismatched KL pairs): the
reference is frozen, so recomputing it per step would only cost time, and the reference model can be freed
before the policy trains. They come from the same `rlbus.modeling` path every other log-prob in the
project uses, either here (`ref_source=local`) or from the ref service over the bus (`ref_source=service`).
SimPO is reference-free and skips that entirely.

Per optimizer step: `batch_size` pairs (KTO: examples), in micro-batches of `micro_batch_size` with
gradient accumulation, AdamW, gradient clipping. Metrics (loss, chosen/rejected rewards, margin, accuracy)
go to the console and `<run.dir>/<run.id>/metrics.jsonl`; the held-out set is evaluated before and after
training (and every `trainer.test_freq` steps), and the final model is saved as a Hugging Face directory
in `<run.dir>/<run.id>/model`.
"""
