"""What an SGLang worker does with an announcement's tensor group, as a process of its own (SGLang's
workers are): join the group as SGLang's `init_custom_process_group` does, then take one broadcast per
announced tensor, for N versions; each version's tensors are saved to OUT_DIR/<i>.pt for the test.

    python tests/per_tensor_replica.py REPLICA_ID ANNOUNCEMENT_FILE VERSIONS OUT_DIR
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from rlbus.messages import WeightAnnouncement, decode
from rlbus.weight_sync import dtype_from_str
from rlbus.weight_sync.per_tensor import join_per_tensor_group


def main(replica_id: str, announcement: Path, versions: int, out_dir: Path) -> None:
    ann = decode(announcement.read_bytes(), WeightAnnouncement)
    g = ann.tensor_group
    assert g is not None and replica_id in g.ranks, ann
    pg = join_per_tensor_group(
        ann.master_addr, g.master_port, g.ranks[replica_id], g.world_size, g.group_name, g.backend, 60
    )
    try:
        for i in range(versions):
            _receive_version(pg, ann, out_dir / f"{i}.pt")
    finally:
        # gloo's threads must be joined before the interpreter exits, or the process aborts
        # ("terminate called without an active exception"), as SGLang's workers destroy theirs
        dist.destroy_process_group(pg)


def _receive_version(pg: dist.ProcessGroup, ann: WeightAnnouncement, out: Path) -> None:
    got = {}
    for name, dtype, shape in zip(ann.names, ann.dtypes, ann.shapes, strict=True):
        t = torch.empty(shape, dtype=dtype_from_str(dtype))
        dist.broadcast(t, src=0, group=pg)
        got[name] = t
    tmp = out.with_suffix(".tmp")
    torch.save(got, tmp)
    tmp.rename(out)


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]))
