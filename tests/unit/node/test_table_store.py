"""The table on disk: a snapshot plus a checksummed append-only log (``node/table/store.py``).
A torn last line after a crash is dropped (never half a table), a rollback is a snapshot,
replay equals the table in memory, and an append writes O(entry) bytes, not O(table)."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _tables import founded, running

from swarmp2p.node.table import events as ev
from swarmp2p.node.table import jobtable
from swarmp2p.node.table.jobtable import JobTable
from swarmp2p.node.table.store import TableStore, load_table


class Writer:
    """Appends events to a table as the leader of ``term`` does, through a store."""

    def __init__(self, store: TableStore, table: JobTable, term: int = 1) -> None:
        self.store, self.table, self.term = store, table, term

    def __call__(self, *events: ev.Event) -> int:
        """Append ``events`` in one write; the bytes that write put on disk."""
        base, table, entries = self.store.table, self.table, []
        for event in events:
            entries.append(ev.Entry(version=table.version + 1, term=self.term, event=event))
            table = jobtable.apply(table, entries[-1])
        before = self.store.bytes_written
        assert self.store.write(table, base, entries)
        self.table = table
        return self.store.bytes_written - before


def _steps(job_id: str, first: int, n: int) -> list[ev.Event]:
    return [
        ev.StepsReported(job_id=job_id, attempt=1, step=s, loss=4.0 - s / 100, at=float(s))
        for s in range(first, first + n)
    ]


def _started(tmp_path: Path, **limits) -> Writer:
    store = TableStore(tmp_path / "jobs.json", **limits)
    table = running().table
    store.snapshot(table)
    return Writer(store, table)


def test_appends_go_to_the_log_and_a_load_replays_them(tmp_path):
    w = _started(tmp_path)
    snapshot = (tmp_path / "jobs.json").read_bytes()
    for step in range(1, 6):
        w(*_steps("j1", step, 1))
    assert (tmp_path / "jobs.json").read_bytes() == snapshot  # the snapshot is not rewritten
    assert len((tmp_path / "jobs.log").read_bytes().splitlines()) == 1 + 5  # header + entries
    assert load_table(tmp_path / "jobs.json") == w.table
    assert w.table.jobs["j1"].step == 5


def test_a_torn_last_entry_at_every_byte_gives_the_table_before_it(tmp_path):
    w = _started(tmp_path)
    w(*_steps("j1", 1, 2))
    before = w.table
    log_file = tmp_path / "jobs.log"
    start = log_file.stat().st_size
    w(ev.JobCancelled(job_id="j1", reason="by the user", at=9.0))
    whole = log_file.read_bytes()
    assert len(whole) > start
    for cut in range(start, len(whole)):
        log_file.write_bytes(whole[:cut])
        assert load_table(tmp_path / "jobs.json") == before, f"cut at byte {cut}"
        assert log_file.stat().st_size == start  # the torn line is gone from the file
    log_file.write_bytes(whole)
    assert load_table(tmp_path / "jobs.json").jobs["j1"].state == "cancelled"


def test_a_bad_line_before_the_last_is_corruption_and_names_the_file(tmp_path):
    w = _started(tmp_path)
    w(*_steps("j1", 1, 1))
    w(*_steps("j1", 2, 1))
    log_file = tmp_path / "jobs.log"
    lines = log_file.read_bytes().splitlines(keepends=True)
    lines[1] = lines[1].replace(b'"step":1', b'"step":7')
    log_file.write_bytes(b"".join(lines))
    with pytest.raises(ValueError, match=r"jobs.log line 2 fails its checksum; move"):
        load_table(tmp_path / "jobs.json")


def test_a_rollback_is_a_snapshot_and_a_stale_log_is_never_replayed(tmp_path):
    """A leader's rollback (or a follower's table cut back to its leader's) rewrites the
    snapshot; a crash between that snapshot and the log's reset leaves the old log, whose
    header names the old snapshot: ignored, so the dropped entries stay dropped."""
    w = _started(tmp_path)
    w(*_steps("j1", 1, 1))
    committed = w.table
    w(*_steps("j1", 2, 3))  # uncommitted, then rolled back
    stale_log = (tmp_path / "jobs.log").read_bytes()
    w.store.snapshot(committed)
    assert load_table(tmp_path / "jobs.json") == committed
    (tmp_path / "jobs.log").write_bytes(stale_log)  # as if the crash came before the reset
    assert load_table(tmp_path / "jobs.json") == committed
    # the same content snapshotted again still gets a log of its own
    w.store.snapshot(committed)
    (tmp_path / "jobs.log").write_bytes(stale_log)
    assert load_table(tmp_path / "jobs.json") == committed


def test_a_write_that_raced_a_rollback_writes_nothing(tmp_path):
    w = _started(tmp_path)
    base = w.store.table
    entry = ev.Entry(version=base.version + 1, term=1, event=_steps("j1", 1, 1)[0])
    newer = jobtable.apply(base, entry)
    rolled = running(job_id="j2").table
    w.store.snapshot(rolled)
    assert not w.store.write(newer, base, [entry])
    assert load_table(tmp_path / "jobs.json") == rolled


def test_a_table_that_does_not_follow_by_entries_is_written_whole(tmp_path):
    w = _started(tmp_path)
    other = founded("a", "b", "c", term=3).table
    assert w.store.write(other, w.store.table, None)
    assert load_table(tmp_path / "jobs.json") == other
    assert len((tmp_path / "jobs.log").read_bytes().splitlines()) == 1  # a fresh log


def test_snapshots_come_periodically_and_replay_equals_memory(tmp_path):
    w = _started(tmp_path, snapshot_entries=7, snapshot_min_bytes=0)
    snapshots = 0
    for step in range(1, 60):
        before = (tmp_path / "jobs.json").read_bytes()
        w(*_steps("j1", step, 1 + step % 3))
        snapshots += (tmp_path / "jobs.json").read_bytes() != before
        assert load_table(tmp_path / "jobs.json") == w.table
    assert snapshots >= 10
    lines = (tmp_path / "jobs.log").read_bytes().splitlines()
    assert len(lines) - 1 <= 7  # the log never holds more than snapshot_entries


def test_an_append_writes_bytes_of_the_entry_not_of_the_table(tmp_path):
    """A table of 200 jobs is some 100s of KB; each append writes one line of a few hundred
    bytes, and the periodic snapshot costs at most the log it replaces."""
    w = _started(tmp_path)
    for i in range(200):
        w(
            ev.JobSubmitted(
                job_id=f"k{i}", job=running().table.jobs["j1"].job, submitted_by="cli", at=1.0
            )
        )
    w.store.snapshot(w.table)
    table_bytes = (tmp_path / "jobs.json").stat().st_size
    assert table_bytes > 200_000
    for step in range(1, 50):
        event = _steps("j1", step, 1)[0]
        entry = ev.Entry(version=w.table.version + 1, term=1, event=event)
        line = len(json.dumps(ev.entry_to_data(entry), separators=(",", ":"))) + 66
        written = w(event)
        assert written <= line + 16, (written, line)
        assert written * 200 < table_bytes


def test_an_old_single_file_table_loads_and_the_next_write_starts_a_log(tmp_path):
    path = tmp_path / "jobs.json"
    table = running().table
    jobtable.save(path, table)  # what every swarmp2p before the log wrote
    store = TableStore(path)
    assert store.load() == table
    w = Writer(store, table)
    w(*_steps("j1", 1, 1))  # no log to append to: a snapshot with one
    w(*_steps("j1", 2, 1))
    assert load_table(path) == w.table
    assert len((tmp_path / "jobs.log").read_bytes().splitlines()) == 2


def test_the_files_are_private(tmp_path):
    w = _started(tmp_path)
    w(*_steps("j1", 1, 1))
    for name in ("jobs.json", "jobs.log"):
        assert stat.S_IMODE(os.stat(tmp_path / name).st_mode) == 0o600, name
