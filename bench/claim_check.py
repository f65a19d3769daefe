"""How fast a claim-checked payload (a group over the message limit, parked in the run's Object Store) is
read back: nats-py's `ObjectStore.get` against rlbus's direct-get reader (rlbus.bus.object_read), side by
side in one run on the same objects, with the put for scale. Prints MB/s of each and their ratio.

    python bench/claim_check.py                      # a NATS server of its own, 9.5 MB objects
    python bench/claim_check.py --url nats://127.0.0.1:4222 --mb 32 --rounds 10
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path

from nats.js import api

from rlbus.bus import LocalNatsServer, connect
from rlbus.bus.object_read import read_object
from rlbus.config.schema import BusConfig


async def bench(url: str, size: int, rounds: int, chunk: int) -> dict[str, list[float]]:
    nc = await connect(BusConfig(url=url), url, name="claim-check-bench")
    js = nc.jetstream()
    bucket = f"claimbench{os.urandom(3).hex()}"
    obs = await js.create_object_store(bucket, config=api.ObjectStoreConfig(storage=api.StorageType.FILE))
    seconds: dict[str, list[float]] = {"put": [], "nats-py get": [], "rlbus read": []}
    try:
        for i in range(rounds):
            data = os.urandom(size)
            meta = api.ObjectMeta(name=f"g{i}", options=api.ObjectMetaOptions(max_chunk_size=chunk))
            t0 = time.perf_counter()
            await obs.put(f"g{i}", data, meta=meta)
            t1 = time.perf_counter()
            got = (await obs.get(f"g{i}")).data
            t2 = time.perf_counter()
            ours = await read_object(js, obs, bucket, f"g{i}")
            t3 = time.perf_counter()
            assert got == data and ours == data
            for key, dt in zip(seconds, (t1 - t0, t2 - t1, t3 - t2), strict=True):
                seconds[key].append(dt)
    finally:
        await js.delete_object_store(bucket)
        await nc.close()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="", help="a NATS server with JetStream; default: one of its own")
    parser.add_argument("--mb", type=float, default=9.5, help="object size in MB (10^6 bytes)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--chunk-kib", type=int, default=1024, help="chunk size (the bus uses up to 1 MiB)")
    args = parser.parse_args()
    size = int(args.mb * 1e6)
    with tempfile.TemporaryDirectory() as tmp:
        server = None if args.url else LocalNatsServer(Path(tmp) / "nats").start()
        try:
            url = args.url or server.url  # type: ignore[union-attr]
            seconds = asyncio.run(bench(url, size, args.rounds, args.chunk_kib * 1024))
        finally:
            if server is not None:
                server.stop()
    rate = {key: size / statistics.median(v) / 1e6 for key, v in seconds.items()}
    for key, v in seconds.items():
        print(f"{key:12s} median {statistics.median(v) * 1000:7.1f} ms  {rate[key]:8.1f} MB/s")
    print(f"read-back speed-up (rlbus read / nats-py get): {rate['rlbus read'] / rate['nats-py get']:.1f}x")


if __name__ == "__main__":
    main()
