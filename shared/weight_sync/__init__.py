"""Weight broadcast from the learner (rank 0) to rollout replicas over a standalone torch process group.

Transport-agnostic on purpose: the services announce a push over NATS (a `WeightAnnouncement` with the
names, dtypes, shapes, buckets, checksum, epoch and rendezvous address) and then call this module. It
imports nothing but torch and the standard library, so it also loads inside a vLLM worker process.

Wire protocol of one push over an open group (every rank runs the same sequence of broadcasts, root 0):

1. header: int64[8] = magic, epoch, plan fingerprint, plan checksum bits, #buckets, payload bytes.
2. one broadcast per bucket: a uint8 buffer = the bucket's tensors' raw bytes at 16-byte aligned offsets,
   then a 32-byte trailer int64[4] = magic (or ABORT), bucket index, payload bytes, int64 word-sum digest.
3. footer: int64[8] = magic, fp64 checksum bits of what was actually sent, status.

The digest makes every bucket verifiable byte-exactly before it is used (a no-op transport leaves a
buffer without the magic; a short or garbled one fails the digest). The sender never leaves receivers
stuck in a half-finished sequence: if its tensor iterator fails it still sends the bucket, marked ABORT;
if a peer dies it aborts the whole group, which makes every other rank's pending broadcast fail at once.
Receivers that reject a bucket drain the rest of the push so the group stays usable for the next version.

Modules: `plan` (metadata, buckets, checksum), `wire` (one bucket's bytes), `group` (the process group),
`sender` and `receiver` (the two ends of a push), `errors`.
"""

from rlbus.weight_sync.errors import RendezvousTimeout, WeightSyncError
from rlbus.weight_sync.group import Backend, WeightGroup, free_port
from rlbus.weight_sync.plan import (
    ALIGN,
    TensorMeta,
    bucket_layout,
    checksums_match,
    describe_tensors,
    dtype_from_str,
    dtype_to_str,
    metas_from_announcement,
    metas_from_lists,
    plan_buckets,
    plan_fingerprint,
    weights_checksum,
)
from rlbus.weight_sync.receiver import WeightReceiver
from rlbus.weight_sync.sender import SendPlan, WeightSender
from rlbus.weight_sync.wire import flatten_bucket, seal_bucket, unflatten_bucket, unseal_bucket

__all__ = [
    "ALIGN",
    "Backend",
    "SendPlan",
    "TensorMeta",
    "WeightGroup",
    "WeightReceiver",
    "WeightSender",
    "RendezvousTimeout",
    "WeightSyncError",
    "bucket_layout",
    "checksums_match",
    "describe_tensors",
    "dtype_from_str",
    "dtype_to_str",
    "flatten_bucket",
    "free_port",
    "metas_from_announcement",
    "metas_from_lists",
    "plan_buckets",
    "plan_fingerprint",
    "seal_bucket",
    "unflatten_bucket",
    "unseal_bucket",
    "weights_checksum",
]
