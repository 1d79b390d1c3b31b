"""The issuing node's serving events on their way to the table, and its view of its served
models meanwhile. Never imports torch.

Only the leader writes the table: the issuing node sends each event it decided
(``serve.note``, in order) and the leader appends it if it follows (``jobtable.apply``). Until
the event is back in this node's replica the node decides on its replica with its own events
applied on top (:meth:`ServeNotes.view`, the same ``apply``), so a failover never waits on the
table. While no leader answers (no quorum, a partition) events wait here and are sent when one
does; serving goes on meanwhile, as the ring and the API need no table. Events are kept in
memory only: a restart before they reach the leader restores from the replica as it was.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from swarmp2p.errors import SwarmError, Unavailable, UserError
from swarmp2p.node.messages import ServeNote, ServeNoted
from swarmp2p.node.table import events as ev
from swarmp2p.node.table import jobtable

if TYPE_CHECKING:
    from swarmp2p.node.context import NodeContext
    from swarmp2p.node.table.served import ServedModel

log = logging.getLogger("swarmp2p.node.serving.notes")


class ServeNotes:
    """Serving events this node decided, in order: queued (unsent) and sent (the leader
    wrote them at a version this node's replica may not hold yet)."""

    def __init__(self, ctx: NodeContext) -> None:
        self.ctx = ctx
        self._queued: list[ev.Event] = []
        self._sent: list[tuple[int, ev.Event]] = []
        self._sending: asyncio.Task | None = None

    def add(self, *events: ev.Event) -> None:
        """Queue ``events`` for the leader (sent at once, in order)."""
        self._queued.extend(events)
        self.kick()

    def kick(self) -> None:
        """Send what waits, unless a send runs (each round retries after a failure)."""
        if self._queued and (self._sending is None or self._sending.done()):
            self._sending = self.ctx.spawn(self._send_all(), "serve-notes")

    async def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued event was written by the leader (None: for one
        ``serve_note_s``); False when not in time (they stay queued)."""
        timings = self.ctx.config.timings
        timeout = timings.serve_note_s if timeout is None else timeout
        self.kick()
        loop = asyncio.get_running_loop()
        until = loop.time() + timeout
        while self._queued and loop.time() < until:
            if self._sending is None or self._sending.done():
                await asyncio.sleep(timings.serve_note_retry_s)  # the last send failed: soon again
                self.kick()
                continue
            with_time = max(0.0, until - loop.time())
            await asyncio.wait({self._sending}, timeout=with_time)
        return not self._queued

    def view(self) -> dict[str, ServedModel]:
        """The served models of this node's replica with this node's events not yet in it
        applied on top. An event that no longer follows (the table moved on) is dropped."""
        table = self.ctx.table
        self._sent = [(v, e) for v, e in self._sent if v > table.version]
        kept: list[ev.Event] = []
        for event in [e for _, e in self._sent] + self._queued:
            entry = ev.Entry(version=table.version + 1, term=max(table.term, 1), event=event)
            try:
                table = jobtable.apply(table, entry)
            except ValueError as exc:
                if any(event is q for q in self._queued):
                    log.warning("dropping serving event %s: %s", event.NAME, exc)
                continue
            kept.append(event)
        self._queued = [e for e in self._queued if any(e is k for k in kept)]
        return table.served

    async def _send_all(self) -> None:
        while self._queued:
            event = self._queued[0]
            note = ServeNote(issuer=self.ctx.node_id, event=ev.event_to_data(event))
            try:
                reply = await self.ctx.to_leader(note, self.ctx.config.timings.serve_note_s)
            except (Unavailable, OSError) as exc:
                log.info("serving event %s waits for a leader: %s", event.NAME, exc)
                return
            except UserError as exc:  # it does not follow, or is refused: it never will
                log.warning("the leader refused serving event %s: %s", event.NAME, exc)
                self._drop(event)
                continue
            except SwarmError as exc:
                log.info("serving event %s not written yet: %s", event.NAME, exc)
                return
            self._drop(event)
            if isinstance(reply, ServeNoted):
                self._sent.append((reply.version, event))

    def _drop(self, event: ev.Event) -> None:
        self._queued = [e for e in self._queued if e is not event]


__all__ = ["ServeNotes"]
