"""How a stage's replicas stay equal (``split.replicas``, ``train.sync``; issue 29).

- ``ring``: the ring among a stage's replicas over their own CURVE links: ``ring_all_reduce``
  (float32, every member the same bits), ``ring_all_gather`` (codes, each member's whole),
  ``ring_broadcast`` (member 0's).
- ``diloco``: DiLoCo's outer step, pure: ``shared_scale``/``encode``/``decode`` (int8 with one
  shared scale, bfloat16, float32), ``OuterStep`` (Nesterov SGD on the averaged change),
  ``sync_replicas`` (what the ring computes, in one process).
- ``sync``: ``ReplicaRing``/``ReplicaSync``, what the training loop (``steps``) calls: replica
  0's weights at the start, gradients averaged before the verdict (step mode), the outer step
  every H steps and after the last (DiLoCo), bytes and seconds per sync.
"""

from swarmp2p.runtime.torch.train.replicas.diloco import (
    WIRE_BITS,
    OuterStep,
    decode,
    encode,
    mean_change,
    shared_scale,
    sync_replicas,
)
from swarmp2p.runtime.torch.train.replicas.ring import (
    BROADCAST_FLAG,
    GATHER_FLAG,
    SYNC_FLAG,
    SyncError,
    ring_all_gather,
    ring_all_reduce,
    ring_broadcast,
)
from swarmp2p.runtime.torch.train.replicas.sync import ReplicaRing, ReplicaSync

__all__ = [
    "BROADCAST_FLAG",
    "GATHER_FLAG",
    "SYNC_FLAG",
    "WIRE_BITS",
    "OuterStep",
    "ReplicaRing",
    "ReplicaSync",
    "SyncError",
    "decode",
    "encode",
    "mean_change",
    "ring_all_gather",
    "ring_all_reduce",
    "ring_broadcast",
    "shared_scale",
    "sync_replicas",
]
