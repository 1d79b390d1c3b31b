"""A stage server: one stage of a serving ring, serving many sessions at once.

It reads ring messages (``swarmp2p.serve.protocol``) from the link before it and runs its blocks
on the sessions' caches: each decode message is ONE batched forward over its group's rows
(continuous batching: sessions join and leave groups between steps, and the caches of a group
live in one :class:`~swarmp2p.runtime.torch.serve.session_cache.SessionBatch` written in place), and a
prompt is prefilled chunk by chunk, a chunk between two decode steps, so a long prompt does not
stall the others. It sends the hidden state on, through the boundary's compression, to the link
after it (a trained learned bottleneck: the receive half runs on what arrives, the send half on
what leaves, so only the k-dim code crosses, as its codes when ``send_codes``). The last stage
samples each row's next token with its own sampler (parameters, seed, penalties, a structured
output's grammar mask), so only token ids go back to the session manager. Groups interleave:
while stage 1 runs group A's step, stage 0 runs group B's.

Speculative decoding (``serve.protocol``): a decode step with drafts runs ``1 + k`` positions
per row in the same one forward; the last stage verifies each row's drafts
(:meth:`~swarmp2p.runtime.torch.serve.sampling.SessionSampler.verify`) and rolls its caches
back past the rejected ones at once; an earlier stage rolls a row back when its next step
arrives at a position inside the ones the speculative step wrote (``_Session.floor``). A stage
with recurrent blocks runs the first position only and drops the drafts (``spec_off``).
With a draft model (``drafter``, stage 0 only: ``serve.draft``) stage 0 drafts the tokens a
step ``asks`` for each row, then runs its blocks on them, and the last stage returns the kept
drafted ids (``Tokens.accepted``).
"""

from __future__ import annotations

import collections
import sys
import threading
import time
from dataclasses import dataclass, replace

import torch

from swarmp2p.net import Link, LinkTimeout
from swarmp2p.runtime.torch.model.introspect import LINEAR_ATTENTION
from swarmp2p.runtime.torch.model.stage import Stage
from swarmp2p.runtime.torch.serve.draft import DraftModel
from swarmp2p.runtime.torch.serve.prefill import Chunk, PrefillQueue, pad_right
from swarmp2p.runtime.torch.serve.sampling import (
    GrammarTokenizer,
    SessionSampler,
    session_matcher,
)
from swarmp2p.runtime.torch.serve.session_cache import PrefixStore, SessionBatch
from swarmp2p.runtime.torch.serve.speculative import (
    draft_ids,
    draft_step,
    forced_ids,
    no_speculation,
    take_back,
    verify_rows,
)
from swarmp2p.runtime.torch.train.boundary import (
    BoundaryError,
    apply_boundary,
    from_frame,
    to_frame,
)
from swarmp2p.serve.decoding.prefix import BLOCK_TOKENS, PrefixPlan
from swarmp2p.serve.protocol import (
    Decode,
    End,
    Failed,
    Prefill,
    SamplingParams,
    Tokens,
    decode_message,
)
from swarmp2p.serve.scheduler import next_stage_work
from swarmp2p.serve.spec import boundary_codec
from swarmp2p.timings.workers import WORKER_TIMINGS
from swarmp2p.wire import CODECS, TensorFrame, WireError, encode_tensor

PREFILL_CHUNK_TOKENS = 64
"""Prompt tokens one prefill forward takes at most. A chunk runs between two decode steps, so
it bounds how long a new prompt delays the running sessions' next tokens (64 tokens of the
135M embedded model: ~0.2 s on one CPU thread, about two batched decode steps of 8 sessions)."""
PREFILL_BATCH_TOKENS = 256
"""Padded prompt tokens (rows x the widest chunk) one prefill forward takes at most. The first
chunks of new sessions that wait together run as ONE forward, padded on the right: on one CPU
thread the embedded model prefilled four 39-token prompts in 477 ms together against 4 x 211 ms
one by one, and the four then decode as one group from their first step."""
MAX_DRAIN = 256
"""Messages taken from the link before the next unit of work runs."""


@dataclass(kw_only=True, slots=True, eq=False)
class _Session:
    """One session at this stage: where its caches live, and how the last stage samples it."""

    sampler: SessionSampler | None
    """The last stage's token picker (None elsewhere)."""
    sampling: SamplingParams | None
    prompt_len: int | None
    grammar: str | None
    last_used: float
    prefilling: bool = True
    """Until its last prefill chunk has run here."""
    batch: SessionBatch | None = None
    row: int = 0
    floor: int | None = None
    """After a speculative step here: the fewest tokens the row may be rolled back to (its
    newest token kept, its drafts not yet known to be); None: no rollback allowed."""
    prefix: PrefixPlan | None = None
    """The prefix cache's plan for it (its first chunk forwards it to the next stage)."""
    cached: list | None = None
    """The reused blocks, copied into its row when its first chunk runs."""

    @property
    def reused(self) -> int:
        return 0 if self.prefix is None else self.prefix.reused_tokens

    @property
    def length(self) -> int:
        """Tokens its caches hold (before its first chunk: the reused ones)."""
        return self.reused if self.batch is None else self.batch.lengths[self.row]


class SessionRefused(RuntimeError):
    """The stage cannot take this step (no room, context full, out of order)."""


class StageServer:
    """Serve one stage between two links. Each decode message is one batched forward over its
    group's rows; prefills run chunk by chunk, a chunk between two decode steps, so a long
    prompt delays the others' next tokens by one chunk at most. ``serve_forever`` loops until a
    stop event; ``handle`` takes one message and runs all the work it makes (for tests). A last
    stage computes its head for the last position only."""

    def __init__(
        self,
        stage: Stage,
        *,
        inbound: Link,
        outbound: Link,
        send_compression: str = "none",
        send_codes: bool = False,
        max_sessions: int = 16,
        max_context: int = 2048,
        send_timeout: float = 30.0,
        receiver: torch.nn.Module | None = None,
        sender: torch.nn.Module | None = None,
        send_codec: str = "none",
        prefill_chunk: int = PREFILL_CHUNK_TOKENS,
        prefill_batch_tokens: int = PREFILL_BATCH_TOKENS,
        grammar_tokenizer: GrammarTokenizer | None = None,
        drafter: DraftModel | None = None,
    ) -> None:
        if drafter is not None and not stage.is_first_stage:
            raise ValueError("drafter: the draft model runs on the first stage, which reads ids")
        if receiver is not None and stage.is_first_stage:
            raise ValueError(
                "receiver: the first stage reads token ids, it has no boundary before it"
            )
        if sender is not None and (stage.is_last_stage or send_compression != "none"):
            raise ValueError(
                "sender: a learned boundary's send half replaces send_compression "
                f"({send_compression!r}); the last stage sends no hidden state"
            )
        if send_codec != "none" and (sender is None or send_codec not in CODECS):
            raise ValueError(
                f"send_codec: {send_codec!r} goes with a sender, as one of the wire's codecs"
            )
        if type(prefill_chunk) is not int or prefill_chunk < 1:
            raise ValueError(f"prefill_chunk: {prefill_chunk!r} is not an integer >= 1")
        self.stage = stage
        self.inbound = inbound
        self.outbound = outbound
        self.receiver = receiver
        self.sender = sender
        self.send_compression = "none" if stage.is_last_stage else send_compression
        if sender is not None:
            # the sender's output crosses as its codes (exact, wire v2) or as plain floats
            self.codec = send_codec if send_codes else "none"
        else:
            self.codec = boundary_codec(self.send_compression, send_codes)
        self.max_sessions = max_sessions
        self.max_context = max_context
        self.send_timeout = send_timeout
        self.prefill_chunk = prefill_chunk
        self.grammar_tokenizer = grammar_tokenizer
        self.drafter = drafter
        """Stage 0's draft model (None: the steps' ``asks`` are declined with ``spec_off``)."""
        """The last stage's tokenizer for grammar sessions (None: they are refused)."""
        self.sessions: dict[int, _Session] = {}
        self.prefix = PrefixStore()
        """The prompt blocks the issuing node's prefix index says this stage holds."""
        self.steps = 0
        """Forwards run (a decode step of a whole group counts once)."""
        self.last_batch = 0
        """Rows of the latest decode step."""
        self.peak_batch = 0
        """Most rows any decode step had."""
        self.peak_prefill_rows = 0
        """Most sessions one prefill forward took."""
        self.busy_s = 0.0
        """Seconds spent in forwards (against wall time: how busy this stage is)."""
        self._chunks = PrefillQueue(
            batch_tokens=prefill_batch_tokens,
            reads_ids=stage.is_first_stage,
            # a recurrent block's state would take in the padding: its prompts batch at one width
            one_width=LINEAR_ATTENTION in stage.block_types,
        )
        self._decodes: collections.deque[tuple[Decode, list]] = collections.deque()
        self._no_spec = no_speculation(stage)
        self.drafted = 0
        """Drafted positions this stage ran."""
        self._decode_turn = True
        self._dtype = next(
            (p.dtype for p in stage.parameters() if p.is_floating_point()), torch.float32
        )
        self._device = next((p.device for p in stage.parameters()), torch.device("cpu"))
        embed = stage.embed if stage.is_first_stage else None
        self._vocab = getattr(embed, "num_embeddings", None) or getattr(
            stage.config, "vocab_size", None
        )

    # -- the loop ------------------------------------------------------------------------------

    def serve_forever(self, stop: threading.Event, poll_s: float | None = None) -> None:
        """Handle messages until ``stop`` is set (idle, it looks every ``poll_s``; default
        ``WorkerTimings.stage_poll_s``)."""
        poll_s = WORKER_TIMINGS.stage_poll_s if poll_s is None else poll_s
        while not stop.is_set():
            self._send(self._drain(0.0 if self.pending else poll_s))
            if self.pending:
                self._send(self._work())

    @property
    def pending(self) -> bool:
        """Whether work is queued (prefill chunks or decode steps)."""
        return bool(self._chunks or self._decodes)

    def handle(self, parts: list) -> list[list]:
        """The messages to send on after receiving ``parts``, with all the work it queued run."""
        out = self._accept(parts)
        while self.pending:
            out.extend(self._work())
        return out

    def stats(self) -> dict:
        """What this stage is doing: sessions held, rows of the latest and largest decode
        step, forwards run, seconds spent in them, prefill chunks and decode steps waiting."""
        return {
            "sessions": len(self.sessions),
            "batch": self.last_batch,
            "peak_batch": self.peak_batch,
            "peak_prefill_rows": self.peak_prefill_rows,
            "steps": self.steps,
            "drafted": self.drafted,
            "draft_busy_s": round(self.drafter.busy_s, 3) if self.drafter is not None else 0.0,
            "busy_s": round(self.busy_s, 3),
            "waiting": len(self._chunks) + len(self._decodes),
            "prefix_blocks": len(self.prefix.blocks),
            "prefix_bytes": self.prefix.nbytes,
        }

    def _send(self, replies: list[list]) -> None:
        for reply in replies:
            try:
                self.outbound.send(reply, timeout=self.send_timeout)
            except LinkTimeout as e:  # the next stage is gone: its sessions time out at
                # the manager, which re-places it; this stage keeps serving the rest
                print(f"stage {self.stage.layer_start}: dropped a reply: {e}", file=sys.stderr)

    def _drain(self, timeout: float) -> list[list]:
        """Take what has arrived (waiting up to ``timeout`` for the first message)."""
        out: list[list] = []
        for _ in range(MAX_DRAIN):
            try:
                parts = self.inbound.recv(timeout)
            except LinkTimeout:
                break
            out.extend(self._accept(parts))
            timeout = 0.0
        return out

    def _work(self) -> list[list]:
        """Run one unit of queued work: a decode step or a prefill chunk, taking turns
        (:func:`~swarmp2p.serve.scheduler.next_stage_work` decides which)."""
        kind, self._decode_turn = next_stage_work(
            decodes=len(self._decodes), prefills=len(self._chunks), decode_turn=self._decode_turn
        )
        if kind == "decode":
            msg, payload = self._decodes.popleft()
            return self._guard(msg.sids, self._decode, msg, payload)
        if kind is None:
            return []
        chunks = self._chunks.take()
        return self._guard(tuple(c.sid for c in chunks), self._prefill, chunks)

    def _guard(self, sids, run, *args) -> list[list]:
        try:
            return run(*args)
        except (SessionRefused, WireError, ValueError, NotImplementedError) as e:
            return self._error(sids, str(e))
        except Exception as e:  # a failing forward ends its sessions, never the server
            return self._error(sids, f"{type(e).__name__}: {e}")

    def _error(self, sids, message: str) -> list[list]:
        for sid in sids:
            self._drop(sid)
        where = f"stage [{self.stage.layer_start}, {self.stage.layer_end})"
        return [[Failed(sids=tuple(sids), message=f"{where}: {message}").encode()]]

    def _drop(self, sid: int) -> None:
        session = self.sessions.pop(sid, None)
        if session is not None and session.batch is not None:
            session.batch.sids[session.row] = None
        self._chunks.drop(sid)
        if self.drafter is not None:
            self.drafter.drop(sid)

    # -- arrivals ------------------------------------------------------------------------------

    def _accept(self, parts: list) -> list[list]:
        try:
            msg = decode_message(parts[0])
        except (WireError, IndexError) as e:
            print(
                f"stage {self.stage.layer_start}: dropped a malformed message: {e}", file=sys.stderr
            )
            return []
        if isinstance(msg, Failed):
            for sid in msg.sids:
                self._drop(sid)
            return [[msg.encode()]]  # on to the manager, which fails the requests
        if isinstance(msg, End):
            self._drop(msg.sid)
            return [] if self.stage.is_last_stage else [[msg.encode()]]
        if isinstance(msg, Tokens):
            return self._error(msg.sids, "a stage received a tokens message; the ring is miswired")
        if isinstance(msg, Decode):
            self._decodes.append((msg, parts[1:]))
            return []
        try:
            self._open(msg)
        except SessionRefused as e:
            return self._error((msg.sid,), str(e))
        if not self.stage.is_first_stage:
            self._chunks.append(
                Chunk(sid=msg.sid, pos=msg.pos, tokens=msg.tokens, more=msg.more, payload=parts[1:])
            )
            return []
        tokens, pos = msg.tokens, msg.pos
        if not tokens:
            return self._error((msg.sid,), f"prefill for session {msg.sid} carries no token ids")
        if self.drafter is not None:
            self.drafter.extend(msg.sid, pos, tokens)
        for start in range(0, len(tokens), self.prefill_chunk):
            piece = tokens[start : start + self.prefill_chunk]
            more = msg.more or start + self.prefill_chunk < len(tokens)
            self._chunks.append(Chunk(sid=msg.sid, pos=pos + start, tokens=piece, more=more))
        return []

    def _open(self, msg: Prefill) -> None:
        """Start (or restart) a session on its first chunk; check a later chunk's session."""
        if not msg.first:
            session = self.sessions.get(msg.sid)
            if session is None or not session.prefilling:
                raise SessionRefused(
                    f"session {msg.sid}: a prefill chunk at position {msg.pos} but the session "
                    "is not prefilling here"
                )
            return
        self._drop(msg.sid)
        if len(self.sessions) >= self.max_sessions:
            self._evict_idle()
        if len(self.sessions) >= self.max_sessions:
            raise SessionRefused(
                f"already holds {len(self.sessions)} sessions (max_sessions "
                f"{self.max_sessions}); retry when one ends"
            )
        params = msg.sampling if msg.sampling is not None else SamplingParams()
        cached = None
        if msg.prefix is not None:
            try:
                cached = self.prefix.open(msg.prefix, LINEAR_ATTENTION in self.stage.block_types)
            except (KeyError, ValueError) as e:
                raise SessionRefused(f"session {msg.sid}: {e.args[0]}") from None
        if self.drafter is not None:
            try:
                self.drafter.open(msg.sid, msg.prefix)
            except KeyError as e:
                raise SessionRefused(f"session {msg.sid}: {e.args[0]}") from None
        sampler = None
        if self.stage.is_last_stage:
            vocab = getattr(self.stage.config, "vocab_size", None) or 0
            try:
                matcher = session_matcher(self.grammar_tokenizer, msg.grammar, msg.sid)
            except ValueError as e:
                raise SessionRefused(str(e)) from None
            sampler = SessionSampler(params, vocab, prompt_len=msg.prompt_len, matcher=matcher)
            if msg.pos:
                try:  # the reused positions are the prompt's too
                    sampler.observe((), count=msg.pos)
                except ValueError as e:
                    raise SessionRefused(f"session {msg.sid}: prefix: {e}") from None
        self.sessions[msg.sid] = _Session(
            sampler=sampler,
            sampling=msg.sampling,
            prompt_len=msg.prompt_len,
            grammar=msg.grammar,
            last_used=time.monotonic(),
            prefix=msg.prefix,
            cached=cached,
        )

    def _evict_idle(self) -> None:
        """Drop the least recently used session if it has been idle past WorkerTimings.stage_session_idle_s (its
        manager went away without an ``end``)."""
        sid, session = min(self.sessions.items(), key=lambda item: item[1].last_used)
        if time.monotonic() - session.last_used > WORKER_TIMINGS.stage_session_idle_s:
            self._drop(sid)

    # -- one prefill chunk ----------------------------------------------------------------------

    def _prefill(self, chunks: list[Chunk]) -> list[list]:
        """Prefill chunks: a later chunk of one session in its own rows, or the first chunks of
        one or more new sessions as ONE forward, padded on the right to the widest. Each
        session sends on what it would prefilled alone."""
        out: list[list] = []
        ready: list[tuple[Chunk, _Session, torch.Tensor]] = []
        for chunk in chunks:
            session = self.sessions.get(chunk.sid)
            if session is None:
                continue  # ended while the chunk waited
            try:
                if session.length != chunk.pos:  # (a warm session's reused tokens first)
                    raise SessionRefused(
                        f"session {chunk.sid} prefill chunk at position {chunk.pos}, but the "
                        f"cache holds {session.length} tokens (a message was lost)"
                    )
                length = len(chunk.tokens) if self.stage.is_first_stage else None
                x = self._input(chunk.tokens, chunk.payload, rows=1, length=length)
                self._check_room(chunk.sid, chunk.pos + x.shape[1])
            except (SessionRefused, WireError, ValueError) as e:
                out.extend(self._error((chunk.sid,), str(e)))
                continue
            ready.append((chunk, session, x))
        if not ready:
            return out
        sids = [chunk.sid for chunk, _, _ in ready]
        counts = [x.shape[1] for _, _, x in ready]
        chunk, session, x = ready[0]
        if chunk.pos > 0 and session.batch is not None:  # a later chunk: alone, in its rows
            batch = session.batch if session.batch.rows == 1 else self._regroup((chunk.sid,))
        else:
            x = pad_right([x for _, _, x in ready])
            batch = self.stage.new_batch(sids, max_context=self.max_context)
            for row, (_, session, _) in enumerate(ready):
                if session.batch is not None:
                    session.batch.sids[session.row] = None
                session.batch, session.row = batch, row
                if session.cached:  # a warm session: its reused blocks first
                    batch.load_prefix(row, session.cached)
                session.cached = None
            batch.expect(counts)
        now = time.monotonic()
        for _, session, _ in ready:
            session.last_used = now
        heads = [row for row, (chunk, _, _) in enumerate(ready) if not chunk.more]
        head_of = {row: i for i, row in enumerate(heads)}  # row -> its row of the logits
        try:
            result = self._forward(x, batch, counts, heads)
        except Exception as e:  # every row fails with the forward's reason
            return out + self._error(sids, f"{type(e).__name__}: {e}")
        self.steps += 1
        self.peak_prefill_rows = max(self.peak_prefill_rows, len(ready))
        for row, (chunk, session, _) in enumerate(ready):
            if self.stage.is_last_stage:
                logits = result[head_of[row], -1] if row in head_of else None
                out.extend(self._prefilled(chunk, session, counts[row], logits))
            else:
                out.extend(
                    self._prefilled(
                        chunk, session, counts[row], result[row : row + 1, : counts[row]]
                    )
                )
        return out

    def _prefilled(self, chunk: Chunk, session: _Session, count: int, out) -> list[list]:
        """What a session's prefill chunk sends on once it ran: on the last stage, its first
        token (``out``: the logits of its last position; None before the last chunk), else the
        chunk with its hidden state ``out`` (``[1, count, H]``) for the next stage. After its
        last chunk the blocks its prefix plan keeps are stored."""
        first = chunk.pos == session.reused
        if not chunk.more and session.prefix is not None and session.prefix.keep:
            try:
                self.prefix.keep(session.prefix, session.batch, session.row, BLOCK_TOKENS)
            except ValueError as e:
                return self._error((chunk.sid,), f"prefix.keep: {e}")
            if self.drafter is not None:
                self.drafter.keep(chunk.sid, session.prefix)
        if self.stage.is_last_stage:
            session.sampler.observe(chunk.tokens, count=count)
            if out is None:
                return []
            session.sampler.end_of_prompt()
            session.prefilling = False
            token, logprobs = session.sampler.next(out)
            forced = forced_ids(session.sampler)
            reply = Tokens(
                group=-1,
                step=0,
                sids=(chunk.sid,),
                positions=(session.length,),
                tokens=(token,),
                logprobs=(logprobs,) if logprobs else (),
                forced=(forced,) if forced else (),
            )
            return [[reply.encode()]]
        session.prefilling = chunk.more
        # the ids go on only when the last stage needs them, for a penalty or a replayed
        # grammar (it counts the rest)
        keep_ids = (session.sampling is not None and session.sampling.needs_history) or (
            session.grammar is not None and session.prompt_len is not None
        )
        forward = Prefill(
            sid=chunk.sid,
            pos=chunk.pos,
            tokens=chunk.tokens if keep_ids else (),
            more=chunk.more,
            sampling=session.sampling if first else None,
            prompt_len=session.prompt_len if first else None,
            grammar=session.grammar if first else None,
            prefix=session.prefix if first else None,
        )
        return [[forward.encode(), *self._frame(out).to_parts()]]

    # -- one decode step of a group -------------------------------------------------------------

    def _decode(self, msg: Decode, payload: list) -> list[list]:
        out: list[list] = []
        if msg.asks:
            msg, failed = self._draft(msg)
            for sid, why in failed:  # a row its draft model cannot draft fails alone
                out.extend(self._error((sid,), why))
            if not msg.sids:
                return out
        elif self.drafter is not None:
            for sid, pos, token in zip(msg.sids, msg.positions, msg.tokens):
                self.drafter.observe(sid, pos, token)
        width, spec_off = msg.width, msg.spec_off
        if width > 1 and self._no_spec:  # the first position only; the drafts go no further
            width, spec_off = 1, spec_off or self._no_spec
        keep: list[int] = []
        refused: dict[str, list[int]] = {}
        for i, sid in enumerate(msg.sids):
            take_back(self.sessions.get(sid), msg.positions[i])
            why = self._refusal(sid, msg.positions[i], msg.tokens[i] if msg.tokens else None, width)
            if why is None:
                keep.append(i)
            else:
                refused.setdefault(why, []).append(sid)
        for why, sids in refused.items():
            out.extend(self._error(sids, why))
        if not keep:
            return out
        sids = tuple(msg.sids[i] for i in keep)
        positions = tuple(msg.positions[i] for i in keep)
        tokens = tuple(msg.tokens[i] for i in keep) if msg.tokens else ()
        drafts = tuple(msg.drafts[i] for i in keep) if width > 1 else ()
        x = self._step_input(tokens, drafts, payload, rows=len(msg.sids), width=msg.width)
        if len(keep) < len(msg.sids) and not self.stage.is_first_stage:
            x = x[torch.tensor(keep, device=x.device)]
        x = x[:, :width]
        batch = self._regroup(sids)
        now = time.monotonic()
        for sid in sids:
            self.sessions[sid].last_used = now
        try:
            hidden = self._forward(x, batch, width=width)
        except Exception as e:  # every row of the step fails with the forward's reason
            return out + self._error(sids, f"{type(e).__name__}: {e}")
        self.steps += 1
        self.drafted += sum(len(d) for d in drafts)
        self.last_batch = len(sids)
        self.peak_batch = max(self.peak_batch, len(sids))
        sizes = (*msg.sizes, len(sids))
        if not self.stage.is_last_stage:
            for sid, pos in zip(sids, positions):  # its drafts are kept or not at the last stage
                self.sessions[sid].floor = pos + 1 if width > 1 else None
            # only stage 0 reads the ids (the last stage picked them itself)
            step = Decode(
                group=msg.group,
                step=msg.step,
                sids=sids,
                positions=positions,
                sizes=sizes,
                drafts=drafts,
                spec_off=spec_off,
            )
            return [*out, [step.encode(), *self._frame(hidden).to_parts()]]
        samplers = [self.sessions[sid].sampler for sid in sids]
        rows, failed, forced = verify_rows(samplers, hidden, drafts, positions, batch, width)
        for row, message in failed:  # a row whose pick fails (its grammar) fails alone
            out.extend(self._error((sids[row],), message))
        logprobs = [lp for _, _, lp, _ in rows]
        reply = Tokens(
            group=msg.group,
            step=msg.step,
            sids=tuple(sids[r] for r, _, _, _ in rows),
            positions=tuple(positions[r] + 1 for r, _, _, _ in rows),
            tokens=tuple(t for _, t, _, _ in rows),
            sizes=sizes,
            logprobs=tuple(logprobs) if any(lp is not None for lp in logprobs) else (),
            kept=tuple(n for _, _, _, n in rows) if drafts else (),
            accepted=tuple(drafts[r][:n] for r, _, _, n in rows) if drafts else (),
            forced=tuple(forced) if any(forced) else (),
            spec_off=spec_off,
        )
        return [*out, [reply.encode()]]

    def _draft(self, msg: Decode) -> tuple[Decode, list[tuple[int, str]]]:
        """Stage 0: the step with its draft model's drafts (``speculative.draft_step``); each
        row it could not draft is dropped here and named with its reason."""
        if self.drafter is None or not self.stage.is_first_stage:
            off = msg.spec_off or "no draft model at stage 0"
            return replace(msg, asks=(), spec_off=off), []
        step, failed = draft_step(self.drafter, self.sessions, msg)
        for sid, _ in failed:
            self._drop(sid)
        return step, failed

    def _refusal(self, sid: int, pos: int, token: int | None, width: int = 1) -> str | None:
        """Why this stage cannot step a row of ``width`` positions (None: it can); a refused
        session is dropped."""
        session = self.sessions.get(sid)
        if session is None:
            return f"session {sid} is not open here (no prefill, or it ended)"
        if session.prefilling:
            return f"session {sid} got a decode step before its prefill finished"
        if session.length != pos:
            return (
                f"session {sid} step at position {pos}, but the cache holds "
                f"{session.length} tokens (a message was lost)"
            )
        if pos + width > self.max_context:
            return (
                f"session {sid} would hold {pos + width} tokens, over max_context "
                f"{self.max_context}"
            )
        if self.stage.is_first_stage and token is None:
            return f"session {sid}: a decode step without its token id reached the first stage"
        if self.stage.is_first_stage and self._vocab is not None and token >= self._vocab:
            return f"token id {token} is outside the vocabulary ({self._vocab} ids)"
        return None

    def _step_input(self, tokens, drafts, payload: list, *, rows: int, width: int):
        """A decode step's input: stage 0 the ids ``[rows, width]`` (each row's newest token,
        its draft, and its newest token again as padding to the longest draft); later stages
        the hidden state, ``[rows, width, H]``."""
        if not self.stage.is_first_stage:
            x = self._input(tokens, payload, rows=rows, length=None)
            if x.shape[1] != width:
                raise ValueError(
                    f"hidden state of shape {tuple(x.shape)} is not {width} position(s) wide"
                )
            return x
        if not drafts:
            return self._input(tokens, payload, rows=rows, length=1)
        return draft_ids(tokens, drafts, self._vocab, self._device)

    def _regroup(self, sids: tuple[int, ...]) -> SessionBatch:
        """The batch holding exactly ``sids`` as its rows, in order (rows copied on a change)."""
        first = self.sessions[sids[0]]
        if first.batch is not None and first.batch.sids == list(sids):
            return first.batch
        parts = [(self.sessions[sid].batch, self.sessions[sid].row) for sid in sids]
        batch = SessionBatch.gather(parts, sids, max_context=self.max_context)
        for row, sid in enumerate(sids):
            self.sessions[sid].batch, self.sessions[sid].row = batch, row
        return batch

    # -- tensors ---------------------------------------------------------------------------------

    def _check_room(self, sid: int, tokens: int) -> None:
        if tokens > self.max_context:
            raise SessionRefused(
                f"session {sid} would hold {tokens} tokens, over max_context {self.max_context}"
            )

    def _input(self, tokens, payload: list, *, rows: int, length: int | None) -> torch.Tensor:
        """Stage 0: the token ids as ``[rows, length]`` (one row of ``length`` for a prefill,
        one id per row for a decode step); later stages: the hidden state that came with the
        message, ``[rows, T, H]``."""
        if self.stage.is_first_stage:
            if not tokens:
                raise ValueError("the message carries no token ids")
            if self._vocab is not None and max(tokens) >= self._vocab:
                raise ValueError(
                    f"token id {max(tokens)} is outside the vocabulary ({self._vocab} ids)"
                )
            ids = torch.tensor(tokens, dtype=torch.long, device=self._device)
            return ids.view(-1, 1) if length == 1 else ids.view(1, -1)
        if not payload:
            raise ValueError("the message carries no hidden state")
        try:
            tensor = from_frame(TensorFrame.from_parts(payload))
        except BoundaryError as e:
            raise ValueError(str(e)) from None
        if tensor.dim() != 3 or tensor.shape[0] != rows:
            raise ValueError(
                f"hidden state of shape {tuple(tensor.shape)} is not [{rows}, T, H] for "
                f"{rows} row(s)"
            )
        return tensor.to(device=self._device, dtype=self._dtype)

    def _forward(
        self,
        x: torch.Tensor,
        batch: SessionBatch,
        counts: list[int] | None = None,
        heads: list[int] | None = None,
        *,
        width: int = 1,
    ) -> torch.Tensor:
        """The stage over ``x`` on ``batch``. Not last: what crosses the boundary after it. Last:
        the logits of each row's last ``width`` positions (generate's ``logits_to_keep``: a long
        prompt skips T-1 rows of the vocabulary-wide matmul; a speculative step keeps them
        all), ``[rows, width, V]``; for a prefill padded
        on the right, the rows ``heads`` only, at their last real position (``counts``)."""
        started = time.perf_counter()
        try:
            with torch.inference_mode():
                if self.receiver is not None:  # a learned boundary's receive half
                    x = self.receiver(x)
                hidden = self.stage(x, cache=batch, hidden_only=True)
                if not self.stage.is_last_stage:
                    return self._boundary(hidden)
                if heads is None:
                    return self.stage.logits(hidden[:, -width:])
                if not heads:  # no row's prompt ends in this chunk
                    return hidden[:0]
                rows = torch.tensor(heads, device=hidden.device)
                last = torch.tensor([counts[r] - 1 for r in heads], device=hidden.device)
                return self.stage.logits(hidden[rows, last].unsqueeze(1))
        finally:
            self.busy_s += time.perf_counter() - started

    def _boundary(self, out: torch.Tensor) -> torch.Tensor:
        """A hidden state as it leaves this (not last) stage: the learned sender's code, or the
        boundary's compression applied in the graph."""
        if self.sender is not None:
            return self.sender(out)
        if self.codec == "none":
            return apply_boundary(out, self.send_compression)
        return out

    def _frame(self, hidden: torch.Tensor) -> TensorFrame:
        if self.sender is None and self.codec != "none":  # the boundary's codes, lossy
            return encode_tensor(hidden.detach().cpu().float().numpy(), self.codec)
        return to_frame(hidden, self.codec)  # a sender's codes only where they decode exactly
