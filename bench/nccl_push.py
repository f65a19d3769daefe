"""Weight-push bandwidth over NCCL between two GPUs of one host, side by side in one run: rlbus's weight push
(WeightSender -> WeightReceiver: buckets, checksums, the learner's bucket size) against a plain
`torch.distributed.broadcast` of the same number of bytes, for the Qwen2-0.5B-shaped model in bf16.

    python bench/nccl_push.py                  # needs two GPUs: the learner side on cuda:0, a replica on cuda:1
    python bench/nccl_push.py --reps 10 --bucket-mb 256
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time
from typing import Any

HOST = "127.0.0.1"


def model_state(device: str, seed: int = 0) -> dict[str, Any]:
    """Random bf16 tensors with the names and shapes of Qwen2-0.5B (tied embeddings), built without an init;
    the shape is bench/learner.py's, so both benches measure the same model."""
    import torch
    from learner import model_config  # bench/ is this script's folder, first on sys.path
    from transformers import Qwen2ForCausalLM

    config = model_config(argparse.Namespace(tiny=False, layers=24))
    with torch.device("meta"):
        shapes = {n: t.shape for n, t in Qwen2ForCausalLM(config).state_dict().items()}
    g = torch.Generator(device=device).manual_seed(seed)
    return {n: torch.randn(s, generator=g, device=device).to(torch.bfloat16) for n, s in shapes.items()}


def plain_broadcast(rank: int, port: int, nbytes: int, reps: int) -> list[float]:
    """Seconds per torch.distributed.broadcast of `nbytes` from rank 0 (after one warm-up)."""
    import torch
    import torch.distributed as dist

    device = torch.device("cuda", rank)
    dist.init_process_group(
        "nccl", init_method=f"tcp://{HOST}:{port}", rank=rank, world_size=2, device_id=device
    )
    buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
    times = []
    try:
        for i in range(reps + 1):
            dist.barrier()
            torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            dist.broadcast(buf, src=0)
            torch.cuda.synchronize(device)
            if i:
                times.append(time.perf_counter() - t0)
    finally:
        dist.destroy_process_group()
    return times


def replica(port: int, inbox: Any, out: Any, nbytes: int, reps: int) -> None:
    """cuda:1: the plain broadcast's receiving rank, then an rlbus replica taking `reps` pushes."""
    from rlbus.weight_sync import WeightReceiver, metas_from_lists

    plain_broadcast(1, port, nbytes, reps)
    receiver = WeightReceiver("cuda:1")
    try:
        while (ann := inbox.get(timeout=600)) is not None:
            receiver.connect(HOST, ann["port"], 1, 2, backend="nccl", epoch=1, timeout_s=120.0)
            metas = metas_from_lists(ann["names"], ann["dtypes"], ann["shapes"])
            t0 = time.perf_counter()
            receiver.receive(metas, ann["buckets"], ann["checksum"])
            out.put(time.perf_counter() - t0)
    finally:
        receiver.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=5, help="timed pushes (after one warm-up) per method")
    p.add_argument("--bucket-mb", type=int, default=64, help="trainer.weight_bucket_mb")
    args = p.parse_args(argv)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    import torch

    if torch.cuda.device_count() < 2:
        print("needs two GPUs of one host", file=sys.stderr)
        return 2
    from rlbus.weight_sync import WeightSender, free_port

    state = model_state("cuda:0")
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    print(
        f"{len(state)} tensors, {nbytes / 1e9:.3f} GB (bf16); {torch.cuda.get_device_name(0)} x2", flush=True
    )
    ctx = mp.get_context("spawn")
    inbox, out = ctx.Queue(), ctx.Queue()
    port = free_port(HOST)
    child = ctx.Process(target=replica, args=(port, inbox, out, nbytes, args.reps), daemon=True)
    child.start()
    try:
        plain = plain_broadcast(0, port, nbytes, args.reps)
        sender = WeightSender(
            "nccl", HOST, timeout_s=120.0, bucket_bytes=args.bucket_mb << 20, device="cuda:0"
        )
        group_port = free_port(HOST)
        pushes = []
        for i in range(args.reps + 1):
            plan = sender.plan(state.items())
            inbox.put({"port": group_port, **plan.announcement_fields()})
            if i == 0:
                sender.open(group_port, 2, epoch=1)
            t0 = time.perf_counter()
            sender.send(iter(state.items()), plan)
            received_s = out.get(timeout=600)
            if i:
                pushes.append(max(time.perf_counter() - t0, received_s))
        inbox.put(None)
        sender.close()
    finally:
        child.join(60)
        if child.is_alive():
            child.kill()
    plain_s, push_s = statistics.median(plain), statistics.median(pushes)
    print(f"plain torch.distributed.broadcast: {plain_s * 1e3:8.1f} ms  {nbytes / plain_s / 1e9:7.1f} GB/s")
    print(
        f"rlbus weight push ({args.bucket_mb} MB buckets): {push_s * 1e3:8.1f} ms  {nbytes / push_s / 1e9:7.1f} GB/s "
        f"({plain_s / push_s:.2f}x the plain broadcast's bandwidth)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
