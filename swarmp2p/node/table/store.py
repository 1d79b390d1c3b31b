"""The job table on disk: a snapshot plus an append-only log of the entries after it. No torch.

An append writes one checksummed line per entry to the log and fsyncs it: O(entry) bytes, not
O(table). Once the log outgrows the snapshot (or holds ``SNAPSHOT_ENTRIES`` entries) the table
is written whole as a new snapshot and the log starts afresh, so the bytes written stay within
twice the log's and a load replays a bounded log. A table that does not follow the one on disk
by entries (a leader's rollback, a whole table from the leader, another history) is written as
a snapshot, never appended.

Files (both 0600): ``jobs.json``, the snapshot ``{"sha256", "table", "log"}`` (the format a
single-file table always had, plus ``log``, a random id), and ``jobs.log``: a header line
naming that id, then one line per entry, each ``<sha256 of the JSON> <JSON>``. A log whose
header names another snapshot is stale (a crash came between a snapshot and the log's reset)
and is ignored; a torn last line (a crash mid-append) is detected by its checksum or missing
newline and dropped, so a load gives the table before that append, never half of it. A line
that fails its checksum before the last one is corruption: the load raises, naming the file.
A table saved by an older swarmp2p (a snapshot without ``log``) loads as it is.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
import threading
from dataclasses import dataclass
from pathlib import Path

from swarmp2p._atomic import write_atomic
from swarmp2p.node.table import events as ev
from swarmp2p.node.table import jobtable
from swarmp2p.node.table.jobtable import MAX_VERSION, JobTable
from swarmp2p.schema import SchemaError

log = logging.getLogger("swarmp2p.node.table.store")

SNAPSHOT_ENTRIES = 1024
"""Entries the log holds at most before a snapshot: bounds a load's replay."""
SNAPSHOT_MIN_BYTES = 64 * 1024
"""A snapshot is due once the log holds more bytes than the snapshot, and at least this many
(a small table is not rewritten every few entries)."""
LOG_FORMAT = 1

__all__ = [
    "SNAPSHOT_ENTRIES",
    "SNAPSHOT_MIN_BYTES",
    "TableStore",
    "load_table",
    "load_vote",
    "save_vote",
    "set_aside",
]


def _line(data: object) -> bytes:
    body = json.dumps(data, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(body).hexdigest().encode() + b" " + body + b"\n"


def _parse_line(line: bytes) -> object | None:
    """The JSON a log line holds; None when it is torn or fails its checksum."""
    if not line.endswith(b"\n") or len(line) < 66 or line[64:65] != b" ":
        return None
    digest, body = line[:64], line[65:-1]
    if hashlib.sha256(body).hexdigest().encode() != digest:
        return None
    try:
        return json.loads(body)
    except ValueError:
        return None


@dataclass(slots=True)
class _Log:
    """What the log on disk holds: its id (the snapshot's), entries and bytes since it began."""

    log_id: str
    entries: int = 0
    nbytes: int = 0
    snapshot_bytes: int = 0


class TableStore:
    """The table file and its log; ``table`` is what they hold. Thread-safe: writes run in a
    thread (the event loop keeps answering) while a rollback may write from the loop."""

    def __init__(
        self,
        path: Path,
        *,
        snapshot_entries: int = SNAPSHOT_ENTRIES,
        snapshot_min_bytes: int = SNAPSHOT_MIN_BYTES,
    ) -> None:
        self.path = Path(path)
        self.log_path = self.path.with_name(self.path.stem + ".log")
        self.snapshot_entries = snapshot_entries
        self.snapshot_min_bytes = snapshot_min_bytes
        self.table = JobTable()
        """The table the files hold."""
        self.bytes_written = 0
        """Bytes this store wrote (snapshots and log lines): what the tests and bench count."""
        self._log: _Log | None = None
        self._lock = threading.Lock()

    # --- reading ------------------------------------------------------------------------------

    def load(self) -> JobTable:
        """The snapshot with the log replayed (an empty table when there is none); ValueError
        naming the file when either is corrupt. A torn last log line is dropped from the file."""
        with self._lock:
            table, log_id, size = self._read_snapshot()
            self.table = table
            if log_id is None:  # absent, or a single-file table of an older swarmp2p
                self._log = None
                return table
            self._log = _Log(log_id=log_id, snapshot_bytes=size)
            try:
                raw = self.log_path.read_bytes()
            except FileNotFoundError:
                self._log = None
                return table
            self.table = self._replay(table, log_id, raw)
            return self.table

    def _read_snapshot(self) -> tuple[JobTable, str | None, int]:
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return JobTable(), None, 0
        try:
            log_id = json.loads(text).get("log")
        except (ValueError, AttributeError):
            log_id = None  # jobtable.load names what is wrong
        table = jobtable.load(self.path)
        return table, log_id if isinstance(log_id, str) else None, len(text)

    def _replay(self, table: JobTable, log_id: str, raw: bytes) -> JobTable:
        lines = raw.splitlines(keepends=True)
        header = _parse_line(lines[0]) if lines else None
        if not (isinstance(header, dict) and header.get("log") == log_id):
            if header is not None or len(lines) > 1:
                log.warning(
                    "%s belongs to another snapshot of %s; ignored", self.log_path, self.path
                )
            self._log = None  # the next write starts a log of its own
            return table
        good = len(lines[0])
        assert self._log is not None
        for i, line in enumerate(lines[1:], start=2):
            data = _parse_line(line)
            if data is None:
                if i < len(lines):
                    raise ValueError(
                        f"job table log {self.log_path} line {i} fails its checksum; move "
                        f"{self.path} and {self.log_path} away to start empty"
                    )
                log.warning(
                    "job table log %s: its last entry was torn (a crash mid-write); dropped",
                    self.log_path,
                )
                with open(self.log_path, "r+b") as f:
                    f.truncate(good)
                    os.fsync(f.fileno())
                break
            try:
                table = jobtable.apply(table, ev.entry_from_data(data))
            except (SchemaError, ValueError) as exc:
                raise ValueError(
                    f"job table log {self.log_path} line {i} does not follow the table: {exc}; "
                    f"move {self.path} and {self.log_path} away to start empty"
                ) from None
            good += len(line)
            self._log.entries += 1
        self._log.nbytes = good
        return table

    # --- writing ------------------------------------------------------------------------------

    def write(self, table: JobTable, base: JobTable, entries: list[ev.Entry] | None) -> bool:
        """Make the files hold ``table``: ``entries`` appended when they lead from ``base``,
        the table on disk, to it; a snapshot otherwise or when one is due. False (nothing
        written) when ``base`` is no longer the table on disk: a rollback wrote meanwhile,
        and the caller writes its newest table again."""
        with self._lock:
            if base is not self.table:
                return False
            if (
                entries
                and self._log is not None
                and entries[0].version == base.version + 1
                and (entries[-1].term, entries[-1].version) == table.key
                and not self._snapshot_due(len(entries))
            ):
                self._append(entries)
            else:
                self._snapshot(table)
            self.table = table
            return True

    def snapshot(self, table: JobTable) -> None:
        """Write ``table`` whole (a rollback, another history) and start an empty log."""
        with self._lock:
            self._snapshot(table)
            self.table = table

    def _snapshot_due(self, more: int) -> bool:
        assert self._log is not None
        return self._log.entries + more > self.snapshot_entries or self._log.nbytes > max(
            self._log.snapshot_bytes, self.snapshot_min_bytes
        )

    def _append(self, entries: list[ev.Entry]) -> None:
        assert self._log is not None
        data = b"".join(_line(ev.entry_to_data(e)) for e in entries)
        fd = os.open(self.log_path, os.O_WRONLY | os.O_APPEND)
        try:
            if os.write(fd, data) != len(data):
                raise OSError(f"short write to {self.log_path}")
            os.fsync(fd)
        except BaseException:
            self._log = None  # a line may be torn: the next write is a snapshot
            raise
        finally:
            os.close(fd)
        self._log.entries += len(entries)
        self._log.nbytes += len(data)
        self.bytes_written += len(data)

    def _snapshot(self, table: JobTable) -> None:
        """The snapshot first, then a fresh log naming it: a crash between the two leaves a
        stale log, which the next load ignores (its header names the old snapshot)."""
        log_id = secrets.token_hex(8)
        body = jobtable.encode(table)
        text = json.dumps({"sha256": jobtable.checksum(body), "table": body, "log": log_id})
        write_atomic(self.path, text, mode=0o600)
        header = _line({"log": log_id, "format": LOG_FORMAT})
        write_atomic(self.log_path, header, mode=0o600)
        self._log = _Log(log_id=log_id, nbytes=len(header), snapshot_bytes=len(text))
        self.bytes_written += len(text) + len(header)


def load_table(path: Path) -> JobTable:
    """The table the files at ``path`` hold (snapshot and log): ``TableStore(path).load()``."""
    return TableStore(path).load()


def set_aside(path: Path, table: JobTable) -> Path:
    """Keep ``table`` (another history's, replaced here) beside ``path`` as one file, named by
    its epoch and version; the file's path."""
    aside = path.with_name(f"{path.name}.{table.epoch or 'old'}-{table.version}")
    jobtable.save(aside, table)
    return aside


def load_vote(path: Path) -> tuple[int, str, bool]:
    """(term, candidate, met) this node voted for last (``save_vote``); none when absent or
    unreadable (logged)."""
    try:
        data = json.loads(path.read_text())
        term, who, met = int(data["term"]), str(data["for"]), bool(data.get("met", False))
    except FileNotFoundError:
        return 0, "", False
    except (ValueError, KeyError, TypeError):
        log.warning("%s is unreadable; voting afresh", path)
        return 0, "", False
    return (term, who, met) if 0 <= term < MAX_VERSION else (0, "", met)


def save_vote(path: Path, term: int, candidate: str, met: bool) -> None:
    """This node's vote, durable before it is sent (0600)."""
    data = {"term": term, "for": candidate, "met": met}
    write_atomic(path, json.dumps(data), mode=0o600)
