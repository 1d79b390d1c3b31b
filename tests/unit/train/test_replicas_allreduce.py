"""The replicas' ring all-reduce (runtime/torch/train/replicas.py) over real CURVE links."""

from __future__ import annotations

import threading

import pytest

torch = pytest.importorskip("torch")

from train_models import curve_rings  # noqa: E402

from swarmp2p.plan.speed import ring_sync_bytes  # noqa: E402
from swarmp2p.runtime.torch.train.replicas import SyncError, ring_all_reduce  # noqa: E402

pytestmark = pytest.mark.torch


@pytest.fixture
def ring():
    """Links of a ring (member i dials member i + 1's bound end), closed after."""
    with curve_rings() as make:
        yield make


def _run(links, tensors, step: int):
    out, errors = [None] * len(links), []

    def member(i):
        try:
            out[i] = ring_all_reduce(tensors[i], i, len(links), *links[i], step=step, timeout=10.0)
        except Exception as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=member, args=(i,)) for i in range(len(links))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out, errors


@pytest.mark.parametrize("numel", [1001, 2])
def test_every_member_gets_the_same_bits_of_the_mean(ring, numel):
    links = ring(3)
    g = torch.Generator().manual_seed(numel)
    tensors = [torch.randn(numel, generator=g) for _ in range(3)]
    want = torch.stack([t.double() for t in tensors]).mean(0)
    out, errors = _run(links, [t.clone() for t in tensors], step=7)
    assert not errors, errors
    assert all(torch.equal(out[0], o) for o in out[1:])  # bitwise
    torch.testing.assert_close(out[0].double(), want, rtol=0, atol=1e-6)
    if numel == 1001:  # each member sent what the planner prices (plus the frames' headers)
        payload = ring_sync_bytes(numel * 4, 3)
        sent = links[0][0].bytes_sent
        assert payload <= sent < payload + 4 * 200


def test_a_frame_of_another_step_is_refused_by_name(ring):
    links = ring(2)
    t = [torch.ones(10), torch.ones(10)]
    errors = []

    def member(i, step):
        try:
            ring_all_reduce(t[i], i, 2, *links[i], step=step, timeout=3.0)
        except SyncError as exc:
            errors.append(str(exc))
        except TimeoutError:
            pass

    threads = [threading.Thread(target=member, args=(i, 3 + i)) for i in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    assert any("replica sync of step 3" in e and "got step 4" in e for e in errors), errors


def test_one_member_is_its_own_mean_and_bad_input_is_named():
    t = torch.arange(4.0)
    assert ring_all_reduce(t, 0, 1, None, None, step=0, timeout=1.0) is t
    with pytest.raises(SyncError, match="1-D float32"):
        ring_all_reduce(t.double(), 0, 2, None, None, step=0, timeout=1.0)
    with pytest.raises(SyncError, match="needs links"):
        ring_all_reduce(t, 0, 2, None, None, step=0, timeout=1.0)


def test_a_gather_and_a_broadcast_reach_every_member_and_a_ring_without_links_is_refused(ring):
    import numpy as np

    from swarmp2p.plan.job import SyncConfig
    from swarmp2p.runtime.torch.train.replicas import (
        ReplicaRing,
        ReplicaSync,
        ring_all_gather,
        ring_broadcast,
    )

    links = ring(3)
    mine = [np.full(5, k - 1, dtype=np.int8) for k in range(3)]
    flats = [torch.full((4,), float(k)) for k in range(3)]
    got, errors = [None] * 3, []

    def member(i):
        try:
            got[i] = ring_all_gather(mine[i], i, 3, *links[i], dtype="int8", step=2, timeout=10)
            ring_broadcast(flats[i], i, 3, *links[i], step=2, timeout=10)
        except Exception as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=member, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    for g in got:  # every member holds every member's payload, in rank order
        assert [list(x) for x in g] == [list(m) for m in mine]
    assert all(torch.equal(f, torch.zeros(4)) for f in flats)  # member 0's values everywhere
    with pytest.raises(SyncError, match="need links"):
        ReplicaRing(rank=0, size=2, to_next=None, from_prev=None)
    lone = ReplicaSync(ReplicaRing(rank=0, size=1, to_next=None, from_prev=None),
                       SyncConfig(mode="diloco", every=1))  # fmt: skip
    with pytest.raises(SyncError, match="before align"):
        lone.after_step([torch.zeros(2)], step=0)
