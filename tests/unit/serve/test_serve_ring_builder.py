"""The one ring builder's steps and its cleanup, over recorded stage callables (the daemon's and
LocalRing's real rings run it in tests/integration)."""

from __future__ import annotations

import asyncio

import pytest

from swarmp2p.serve.ring import SHARED_MIN_GROUP_ROWS, build_ring


class Link:
    def __init__(self, endpoint: str) -> None:
        self.endpoint, self.closed = endpoint, False

    def close(self) -> None:
        self.closed = True


def run(n, *, fail_start=None, fail_connect=None, fail_dial=False):
    log: list[tuple] = []
    links: list[Link] = []

    def bind_back():
        links.append(Link("tcp://back"))
        return links[-1]

    async def start(i):
        await asyncio.sleep(0.01 * (n - i))  # the last stage answers first
        log.append(("start", i))
        if i == fail_start:
            raise RuntimeError(f"stage {i} cannot load")
        return f"tcp://stage{i}"

    async def connect(i, after):
        log.append(("connect", i, after))
        if i == fail_connect:
            raise RuntimeError(f"stage {i} cannot dial {after}")

    def dial(endpoint):
        if fail_dial:
            raise OSError("no route")
        links.append(Link(endpoint))
        return links[-1]

    async def stop():
        log.append(("stop",))

    async def main():
        return await build_ring(
            n, bind_back=bind_back, start=start, connect=connect, dial=dial, stop=stop
        )

    try:
        return asyncio.run(main()), log, links
    except Exception as exc:
        return exc, log, links


def test_every_stage_starts_then_each_connects_to_the_next_and_the_last_to_the_return_link():
    ends, log, links = run(3)
    assert sorted(log[:3]) == [("start", 0), ("start", 1), ("start", 2)]
    assert sorted(log[3:]) == [
        ("connect", 0, "tcp://stage1"),
        ("connect", 1, "tcp://stage2"),
        ("connect", 2, "tcp://back"),
    ]
    assert ends.endpoints == ("tcp://stage0", "tcp://stage1", "tcp://stage2")
    assert (ends.back.endpoint, ends.first.endpoint) == ("tcp://back", "tcp://stage0")
    assert not any(link.closed for link in links)


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"fail_start": 1}, "stage 1 cannot load"),
        ({"fail_connect": 2}, "stage 2 cannot dial tcp://back"),
        ({"fail_dial": True}, "no route"),
    ],
)
def test_a_failed_step_stops_every_stage_closes_the_links_and_raises_it(kw, message):
    error, log, links = run(3, **kw)
    assert str(error) == message
    starts = [e for e in log if e[0] == "start"]
    assert len(starts) == 3  # every start finished before the stop: none is left running
    assert log[-1] == ("stop",) and log.count(("stop",)) == 1
    assert links and all(link.closed for link in links)


def test_a_one_stage_ring_sends_straight_back():
    ends, log, _ = run(1)
    assert log == [("start", 0), ("connect", 0, "tcp://back")]
    assert ends.first.endpoint == "tcp://stage0"


@pytest.mark.parametrize(
    ("places", "shared", "rows"),
    [
        ([("a", "cpu"), ("b", "cpu")], False, 1),  # a machine per stage: a group per stage
        ([("a", "cuda:0"), ("a", "cuda:1")], False, 1),
        ([("a", "cpu"), ("a", "cpu")], False, SHARED_MIN_GROUP_ROWS),  # one device, two stages
        ([("local0", "cpu"), ("local1", "cpu")], True, SHARED_MIN_GROUP_ROWS),  # LocalRing's
    ],
)
def test_groups_fill_first_when_stages_share_a_device(places, shared, rows):
    from types import SimpleNamespace

    from swarmp2p.net import InProcLink
    from swarmp2p.serve.ring import RingEnds

    stages = [SimpleNamespace(node_id=n, device=d) for n, d in places]
    plan = SimpleNamespace(
        stages=stages,
        max_context=64,
        max_sessions=4,
        prefix_blocks=0,
        draft=None,
        to_json=lambda: "{}",
    )
    first, _ = InProcLink.pair()
    back, _ = InProcLink.pair()
    client = RingEnds(first=first, back=back, endpoints=[]).open_client(
        plan, step_timeout=5.0, shared=shared
    )
    try:
        assert client.min_group_rows == rows
    finally:
        client.close()
