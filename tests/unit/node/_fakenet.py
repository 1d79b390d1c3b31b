"""A fake in-process network for real Replication objects: every message is encoded and
decoded as on the wire, no sockets. Partitions are the network's: a node's view and its reach
are cut together (``Net.partition``); a node that is ``down`` reaches nobody and nobody
reaches it. A node whose table revokes a key refuses that key's calls (ZAP), and its view
forgets the peers it revoked (the daemon's ``_drop_revoked``).

Also here, for the property tests (``test_replication_props.py``):

- :func:`run_virtual` / :class:`VirtualTimeLoop`: an event loop whose clock jumps to the next
  timer whenever nothing is ready, and whose default executor runs ``to_thread`` work inline:
  a run is deterministic and its timeouts (commit, grace) cost no wall time.
- :class:`History`: a ghost record of every entry any node applied (``jobtable.apply``
  wrapped while :func:`recording` is active), so a table's whole history can be read back from
  its (epoch, term, version) alone.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import selectors
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _tables import bare_record, job

from swarmp2p.net.rpc import RpcTimeout
from swarmp2p.net.security import NodeKey, SwarmSecret
from swarmp2p.node.cluster.membership import Refused
from swarmp2p.node.config import NodeConfig
from swarmp2p.node.context import Identity, NodeContext
from swarmp2p.node.messages import (
    LeadRequest,
    TableEvents,
    TableFetch,
    TablePush,
)
from swarmp2p.node.records import Host
from swarmp2p.node.state import StateDir
from swarmp2p.node.table import events as ev
from swarmp2p.node.table import jobtable
from swarmp2p.node.table.jobtable import JobTable
from swarmp2p.node.table.replication import Replication
from swarmp2p.timings import Timings
from swarmp2p.wire.messages import decode, encode

SECRET = SwarmSecret.generate()


class Net:
    """Which node reaches which; messages cross as bytes, as on a socket."""

    def __init__(self) -> None:
        self.nodes: dict[str, FakeNode] = {}
        self.cut: set[frozenset[str]] = set()
        self.down: set[str] = set()
        """Nodes that answer nobody and reach nobody (crashed, hung, or stopped)."""
        self.observers: list[Callable[[], None]] = []
        """Called before every message is delivered (invariant checks in mid-operation)."""
        self.latency = 0.0
        """Seconds each request takes to arrive (0: at once). On the virtual-time loop, a
        latency is what lets time pass while requests follow one another without end."""
        self.sent = 0

    def reach(self, a: str, b: str) -> bool:
        return frozenset((a, b)) not in self.cut and a not in self.down and b not in self.down

    def partition(self, *sides: set[str]) -> None:
        self.cut = {
            frozenset((x, y)) for s in sides for t in sides if s is not t for x in s for y in t
        }
        self.refresh()

    def heal(self) -> None:
        self.partition()

    def refresh(self) -> None:
        """Every node looks again at whom it reaches."""
        for node in list(self.nodes.values()):
            node.see()


class FakeContext(NodeContext):
    def __init__(self, net: Net, node_id: str, tmp: Path, key: NodeKey | None = None) -> None:
        state = StateDir(root=tmp / node_id).ensure()
        super().__init__(
            me=Identity(
                node_id=node_id,
                name=f"host-{node_id}",
                addresses=("127.0.0.1",),
                record=bare_record(node_id),
                host=Host(),
            ),
            state=state,
            secret=SECRET,
            key=key or NodeKey.generate(),
            config=NodeConfig(
                state_dir=state.root, timings=Timings(heartbeat_s=0.05, failure_timeout_s=0.2)
            ),
        )
        self.net = net
        self.started_at = -1e9  # long past its start-up grace

    async def call_endpoint(self, endpoint, msg, timeout, key=None):
        target = endpoint.removeprefix("fake://")
        if not self.net.reach(self.node_id, target) or target not in self.net.nodes:
            raise RpcTimeout(f"{target} unreachable")
        server = self.net.nodes[target]
        if self.key.public in server.rep.table.revoked:  # its ZAP no longer admits this key
            raise RpcTimeout(f"{target} refuses this node's key")
        if self.net.latency:
            await asyncio.sleep(self.net.latency)
            if not self.net.reach(self.node_id, target):
                raise RpcTimeout(f"{target} unreachable")
        self.net.sent += 1
        for observe in self.net.observers:
            observe()
        reply = await server.handle(decode(encode(msg)), self.node_id)
        return decode(encode(reply))


class FakeNode:
    def __init__(self, net: Net, node_id: str, tmp: Path, key: NodeKey | None = None) -> None:
        self.net, self.tmp = net, tmp
        self.ctx = FakeContext(net, node_id, tmp, key)
        self.rep = Replication(
            self.ctx, self.ctx.state.table_file, self.ctx.state.root / "vote.json"
        )
        self.rep.commit_timeout = 0.5
        self.ctx.attach(local=self.handle, replication=self.rep)

    @property
    def node_id(self) -> str:
        return self.ctx.node_id

    def see(self) -> None:
        """This node's view: every node it reaches is alive (but the ones it revoked)."""
        me = self.ctx.node_id
        revoked = set(self.rep.table.revoked)
        for other in self.net.nodes:
            if other == me:
                continue
            key = self.net.nodes[other].ctx.key.public
            if key in revoked:
                self.ctx.members.forget(other)
            elif self.net.reach(me, other):
                try:
                    self.ctx.keyring.admit(other, key, 0.0)
                except Refused:  # its id was removed: it speaks to nobody here
                    self.ctx.members.forget(other)
                    continue
                held = self.net.nodes[other].rep.table.version  # as its hellos say
                self.ctx.members.hello(
                    node_id=other,
                    name=f"host-{other}",
                    endpoint=f"fake://{other}",
                    record=bare_record(other),
                    now=0.0,
                    held=held,
                )
            else:
                self.ctx.members.dead(other, 0.0, "cut")
        if self.ctx.leader != me:
            self.rep.lost_lead()
        self.rep.note_view()  # as the daemon's heartbeat round does
        self.rep.check_quorum()

    async def restart(self) -> None:
        """Crash and start again from what this node saved (same key, same state folder)."""
        await self.ctx.cancel_tasks()
        timeout = self.rep.commit_timeout
        self.__init__(self.net, self.ctx.node_id, self.tmp, self.ctx.key)
        self.rep.commit_timeout = timeout

    async def handle(self, msg, sender=None):
        sender = sender or self.ctx.node_id
        if isinstance(msg, LeadRequest):
            return self.rep.on_vote_request(msg)
        if isinstance(msg, TableFetch):
            return self.rep.on_fetch(msg)
        if isinstance(msg, TableEvents):
            return await self.rep.on_events(msg, sender)
        if isinstance(msg, TablePush):
            return await self.rep.on_table(msg, sender)
        raise AssertionError(msg)


def swarm(tmp_path, *ids) -> dict[str, FakeNode]:
    net = Net()
    for node_id in ids:
        net.nodes[node_id] = FakeNode(net, node_id, tmp_path)
    net.refresh()
    return net.nodes


async def lead(node: FakeNode) -> None:
    await node.rep.start_takeover()


async def settle(nodes) -> None:
    """Let the pushes in flight land."""
    for _ in range(50):
        await asyncio.sleep(0.01)
        if not any(n.rep._pushing for n in nodes):
            return


_JOB = None


def submit(node: FakeNode, job_id: str):
    global _JOB
    if _JOB is None:
        _JOB = job()
    event = ev.JobSubmitted(job_id=job_id, job=_JOB, submitted_by="cli", at=1.0)
    return node.rep.append([event], wait=True)


# --- deterministic time ---------------------------------------------------------------------


class _InlineExecutor(concurrent.futures.ThreadPoolExecutor):
    """Runs ``to_thread`` work at once, on the loop's thread: no thread decides an order
    (a ThreadPoolExecutor only because the loop takes no other; it never starts one)."""

    def submit(self, fn, /, *args, **kwargs):
        future: concurrent.futures.Future = concurrent.futures.Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # handed to the awaiting task, as a thread would
            future.set_exception(exc)
        return future


class _VirtualSelector:
    """A selector that, when nothing is ready, moves the loop's clock to the next timer
    instead of sleeping."""

    def __init__(self, loop: VirtualTimeLoop) -> None:
        self._loop = loop
        self._real = selectors.DefaultSelector()

    def select(self, timeout=None):
        if timeout is None:  # no timer at all: only another thread can wake the loop
            return self._real.select(None)
        events = self._real.select(0)
        if not events and timeout > 0:
            self._loop.now += timeout
        return events

    def __getattr__(self, name):
        return getattr(self._real, name)


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    def __init__(self) -> None:
        self.now = 0.0
        super().__init__(_VirtualSelector(self))
        self.set_default_executor(_InlineExecutor())

    def time(self) -> float:
        return self.now


def run_virtual(coro):
    """``asyncio.run`` on a :class:`VirtualTimeLoop`."""
    loop = VirtualTimeLoop()
    try:
        return loop.run_until_complete(coro)
    finally:
        close_loop(loop)


def close_loop(loop: asyncio.AbstractEventLoop) -> None:
    tasks = [t for t in asyncio.all_tasks(loop) if not t.done()]
    for task in tasks:
        task.cancel()
    if tasks:
        loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
    loop.run_until_complete(loop.shutdown_asyncgens())
    loop.close()


# --- the ghost history ------------------------------------------------------------------------

Key = tuple[str, int, int]
"""(epoch, term, version) of a table: the entry it ends with, in its history."""


def key_of(table: JobTable) -> Key:
    return (table.epoch, table.term, table.version)


class History:
    """Every entry any node applied: (epoch, term, version) after it -> (the key before it,
    the entry's event as canonical JSON). Two different entries (or parents) behind one key
    are two histories that claim the same place: recorded in ``conflicts``."""

    ROOT: Key = ("", 0, 0)

    def __init__(self) -> None:
        self.parent: dict[Key, tuple[Key, str]] = {}
        self.conflicts: list[str] = []

    def record(self, before: JobTable, entry: ev.Entry, after: JobTable) -> None:
        event = json.dumps(ev.event_to_data(entry.event), sort_keys=True)
        key, value = key_of(after), (key_of(before), event)
        known = self.parent.setdefault(key, value)
        if known != value and len(self.conflicts) < 20:
            self.conflicts.append(
                f"two entries at {key}: {known[1][:120]} after {known[0]} and "
                f"{event[:120]} after {value[0]}"
            )

    def chain(self, key: Key) -> dict[int, Key]:
        """version -> the key of the history ending at ``key``, for every version of it."""
        out: dict[int, Key] = {}
        while key[2] > 0:
            out[key[2]] = key
            if key not in self.parent:
                raise AssertionError(f"no recorded entry made a table {key}")
            key = self.parent[key][0]
        return out

    def event_at(self, key: Key) -> str:
        return self.parent[key][1] if key in self.parent else ""


@contextlib.contextmanager
def recording(history: History) -> Iterator[History]:
    """Record every successful ``jobtable.apply`` into ``history`` while active."""
    real = jobtable.apply

    def apply(table: JobTable, entry: ev.Entry) -> JobTable:
        after = real(table, entry)
        history.record(table, entry, after)
        return after

    jobtable.apply = apply
    try:
        yield history
    finally:
        jobtable.apply = real
