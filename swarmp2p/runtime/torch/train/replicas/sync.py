"""A stage's replicas kept equal from inside the training loop (``steps.run_step``).

The replicas of stage i (one pipeline each, every one holding the same layers) form a ring over
their own links (``ReplicaRing``). ``ReplicaSync`` is what one member does with it:

- at the start, ``align``: replica 0's trained parameters go once round the ring, so every
  replica starts from the same weights whatever it loaded or initialised;
- ``train.sync`` "step": ``average_gradients`` before the optimizer step, after the float16
  loss scale is divided out: the stage's trained parameters' float32 gradients (adapters alone
  in LoRA) are averaged by ``ring_all_reduce``, so every replica steps AdamW on the same bits
  and the replicas stay bitwise equal. The overflow check, the verdict the stages agree on and
  any clipping see the averaged gradient (DDP's order);
- "diloco": ``after_step`` every ``every`` steps: each replica's change since the last sync
  (``OuterStep.changes``) crosses ``bits`` wide with one shared scale (``ring_all_gather`` of
  each member's peak, then of its codes: int8 codes cannot be summed in int8 on the way), every
  member sums the same values in replica order (``mean_change``), and the anchor takes the
  outer Nesterov step; every replica copies the new anchor into its parameters (and their
  float32 master copies). 32 bits go through ``ring_all_reduce`` instead.

Every sync counts the bytes this member sent (frame headers included) and its seconds.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from swarmp2p.net.links import Link
from swarmp2p.plan.job import SyncConfig
from swarmp2p.runtime.torch.train.replicas.diloco import OuterStep, decode, encode, shared_scale
from swarmp2p.runtime.torch.train.replicas.ring import (
    SyncError,
    ring_all_gather,
    ring_all_reduce,
    ring_broadcast,
)


@dataclass(frozen=True, kw_only=True, slots=True)
class ReplicaRing:
    """This member's place among a stage's replicas and its two links (``to_next`` dials the
    next member, ``from_prev`` is the end the previous one dials)."""

    rank: int
    size: int
    to_next: Link | None
    from_prev: Link | None
    timeout: float = 60.0

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise SyncError(f"replica {self.rank} outside {self.size} replicas")
        if self.size > 1 and (self.to_next is None or self.from_prev is None):
            raise SyncError(f"{self.size} replicas need links to the next and from the previous")

    @property
    def sent(self) -> int:
        return self.to_next.bytes_sent if self.to_next is not None else 0


def _flat(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).float().cpu() for t in tensors])


@torch.no_grad()
def _unflat(flat: torch.Tensor, into: Sequence[torch.Tensor]) -> None:
    at = 0
    for t in into:
        n = t.numel()
        t.copy_(flat[at : at + n].view_as(t))
        at += n


class ReplicaSync:
    """One member of a stage's replica ring in the loop: ``align`` once, then per step
    ``average_gradients`` (step mode) or ``after_step`` (DiLoCo). ``bytes_sent``/``sync_s``:
    totals; ``last_bytes``/``last_s``: the latest sync's."""

    def __init__(self, ring: ReplicaRing, sync: SyncConfig) -> None:
        self.ring, self.sync = ring, sync
        self.mode, self.bits = sync.mode, sync.wire_bits
        self.bytes_sent = 0
        self.sync_s = 0.0
        self.last_bytes = 0
        self.last_s = 0.0
        self.syncs = 0
        self.outer: OuterStep | None = None
        self.end: int | None = None
        """The step count the run ends at: DiLoCo syncs after the last step too, so what is
        exported and evaluated is the synchronised weights."""

    # --- bookkeeping ------------------------------------------------------------------------

    def _run(self, fn, *args):
        sent0, began = self.ring.sent, time.perf_counter()
        out = fn(*args)
        self.last_bytes, self.last_s = self.ring.sent - sent0, time.perf_counter() - began
        self.bytes_sent += self.last_bytes
        self.sync_s += self.last_s
        self.syncs += 1
        return out

    def _reduce(self, flat: torch.Tensor, step: int, timeout: float | None = None) -> torch.Tensor:
        r = self.ring
        return ring_all_reduce(
            flat, r.rank, r.size, r.to_next, r.from_prev, step=step, timeout=timeout or r.timeout
        )

    @property
    def _outer_wait(self) -> float:
        """How long an outer step's first message may take: replicas run their H inner steps
        alone, so a slower one may arrive up to H steps' worth of link timeouts later."""
        return self.ring.timeout * self.sync.inner_steps

    # --- the three moments ------------------------------------------------------------------

    def align(self, params: Sequence[torch.Tensor], step: int, end: int | None = None) -> None:
        """Replica 0's ``params`` into every member's (in place), and the DiLoCo anchor;
        ``end``: the step count the run ends at (a last outer step there)."""
        self.end = end
        if self.ring.size > 1:
            r = self.ring
            flat = _flat(params)
            ring_broadcast(flat, r.rank, r.size, r.to_next, r.from_prev, step=step,
                           timeout=r.timeout)  # fmt: skip
            _unflat(flat, params)
        if self.mode == "diloco":
            self.outer = OuterStep(params, lr=self.sync.lr, momentum=self.sync.momentum)

    def average_gradients(self, grads: Sequence[torch.Tensor], step: int) -> None:
        """Step mode: every gradient in ``grads`` replaced, in place, by its mean over the
        replicas (the same bits on each)."""
        if self.mode != "step" or self.ring.size == 1 or not grads:
            return
        flat = _flat(grads)
        self._run(self._reduce, flat, step)
        _unflat(flat, grads)

    def due(self, step: int) -> bool:
        """Whether ``step`` (0-based) ends DiLoCo's inner steps."""
        if self.mode != "diloco":
            return False
        return (step + 1) % self.sync.inner_steps == 0 or step + 1 == self.end

    def after_step(self, params: Sequence[torch.Tensor], step: int) -> bool:
        """DiLoCo: at the end of every ``every``-th step, the outer step; ``params`` (the float32
        truth: the optimizer's master copies) take the new anchor in place. Whether it ran."""
        if not self.due(step):
            return False
        if self.outer is None:
            raise SyncError("a DiLoCo replica stepped before align() set its anchor")
        anchor = self._run(self._outer, params, step)
        with torch.no_grad():
            for p, a in zip(params, anchor):
                p.copy_(a)
        return True

    def _outer(self, params: Sequence[torch.Tensor], step: int) -> list[torch.Tensor]:
        assert self.outer is not None
        changes = self.outer.changes(params)
        if self.ring.size == 1:
            return self.outer.apply(changes)
        if self.bits == 32:
            flat = self._reduce(_flat(changes), step, self._outer_wait)
            averaged = [torch.empty_like(c) for c in changes]
            _unflat(flat, averaged)
            return self.outer.apply(averaged)
        r = self.ring
        mine = np.array([float(c.abs().max()) if c.numel() else 0.0 for c in changes], np.float32)
        peaks = ring_all_gather(mine, r.rank, r.size, r.to_next, r.from_prev, dtype="float32",
                                step=step, timeout=self._outer_wait)  # fmt: skip
        column = torch.from_numpy(np.stack(peaks))  # [replica, parameter]
        scales = [shared_scale([column[:, i]], self.bits) for i in range(len(changes))]
        flat = torch.cat(
            [encode(c.cpu(), self.bits, s).reshape(-1) for c, s in zip(changes, scales)]
        )
        wire = flat.numpy() if self.bits == 8 else flat.view(torch.uint16).numpy()
        codes = ring_all_gather(wire, r.rank, r.size, r.to_next, r.from_prev,
                                dtype="int8" if self.bits == 8 else "bfloat16",
                                step=step, timeout=r.timeout)  # fmt: skip
        averaged = []
        at = 0
        for c, scale in zip(changes, scales):
            n = c.numel()
            total = torch.zeros(n, dtype=torch.float32)
            for got in codes:  # replica order on every member: the same sum, bit for bit
                t = torch.from_numpy(np.array(got[at : at + n]))
                t = t if self.bits == 8 else t.view(torch.bfloat16)
                total += decode(t, self.bits, scale)
            averaged.append((total / r.size).view_as(c).to(c.device))
            at += n
        return self.outer.apply(averaged)


__all__ = ["ReplicaRing", "ReplicaSync"]
