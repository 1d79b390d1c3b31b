"""The issuing node's view while its serving events wait for the leader: its replica with
its unsent events applied on top by the same ``apply``; an event that no longer follows is
dropped; events the leader wrote leave once the replica holds their version."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _tables import serving

from swarmp2p.errors import Unavailable
from swarmp2p.node.serving.notes import ServeNotes
from swarmp2p.node.table import events as ev
from swarmp2p.timings import Timings


class Node:
    """What ServeNotes needs of a node: its replica, its id, its timings, tasks, and a leader
    that is unreachable (``answer`` None) or writes each event into ``log``."""

    def __init__(self, log, answer=None):
        self.log, self.node_id, self.answer = log, "a", answer
        self.config = SimpleNamespace(timings=Timings(serve_note_s=0.5, serve_note_retry_s=0.05))
        self.tasks: list[asyncio.Task] = []

    @property
    def table(self):
        return self.log.table

    def spawn(self, coro, name):
        task = asyncio.ensure_future(coro)
        self.tasks.append(task)
        return task

    async def to_leader(self, msg, timeout):
        if self.answer is None:
            raise Unavailable("no leader", code="no_quorum")
        return self.answer(msg)


def lost(stage=1, node="b"):
    return ev.ServeStageLost(serve_id="s1", attempt=1, stage=stage, node_id=node, at=3.0)


def test_unsent_events_are_decided_on_and_one_that_no_longer_follows_is_dropped():
    async def main():
        node = Node(serving())
        notes = ServeNotes(node)
        notes.add(lost(), ev.ServeStageLost(serve_id="s1", attempt=9, stage=0, node_id="a", at=4.0))
        await asyncio.gather(*node.tasks)
        view = notes.view()
        assert node.table.served["s1"].state == "serving"  # the replica did not change
        assert (view["s1"].state, view["s1"].lost) == ("replacing", (1,))
        assert len(notes._queued) == 1  # the stale attempt's event was dropped
        assert not await notes.flush(timeout=0.3)  # no leader: it waits
        loop = asyncio.get_running_loop()
        started = loop.time()
        assert not await notes.flush()  # for one serve_note_s: 0.5 s here (10 s by default)
        assert 0.5 <= loop.time() - started < 5.0

    asyncio.run(main())


def test_events_the_leader_wrote_leave_once_the_replica_holds_them():
    async def main():
        log = serving()
        leader = serving()  # the leader's table, one entry ahead of the replica after a write

        def write(msg):
            from swarmp2p.node.messages import ServeNoted

            leader(ev.event_from_data(msg.event))
            return ServeNoted(version=leader.table.version)

        node = Node(log, answer=write)
        notes = ServeNotes(node)
        notes.add(lost())
        assert await notes.flush(timeout=2.0)
        assert notes.view()["s1"].state == "replacing"  # sent, not yet in the replica
        log(lost())  # replication brings it
        assert notes.view()["s1"].lost == (1,) and notes._sent == []

    asyncio.run(main())
