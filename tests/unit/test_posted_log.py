"""The posted log (docs/DESIGN.md §7): the probe's writer (probe/history.py, appendlog.py) fed
recorder pickles by a stand-in for torch, and the reader (evidence/posted_log.py) on what it
wrote and on torn or garbage files, and the log cut to its newest part for another node. No
process here: tests/e2e/test_posted_endings.py ends real gloo ranks."""

from __future__ import annotations

import contextlib
import json
import pickle
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from moe_hang.evidence import flight_recorder as fr
from moe_hang.evidence.load import load_capture
from moe_hang.evidence.posted_log import parse_posted_log, read_posted_log, tail
from moe_hang.probe import appendlog, history
from moe_hang.probe.layout import RunLayout

FIXTURES = Path(__file__).resolve().parent / "fixtures"
JOB = "/job/train.py"


def _entry(rid: int, *, op: str = "all_reduce", tid: str = "11", frames: bool = False,
           retired: bool = True, pg: int = 0) -> dict[str, Any]:
    e: dict[str, Any] = {
        "record_id": rid, "pg_id": pg, "process_group": (str(pg), "default_pg"),
        "collective_seq_id": rid + 1, "p2p_seq_id": 0, "op_id": rid + 1,
        "profiling_name": f"gloo:{op}", "time_created_ns": 1_000_000 + rid,
        "input_sizes": [[4]], "input_dtypes": ["Float"], "output_sizes": [[4]],
        "output_dtypes": ["Float"], "state": "scheduled", "retired": retired,
        "is_p2p": False, "thread_id": tid, "thread_name": "python"}
    if frames:
        e["frames"] = [{"name": "all_reduce", "filename": "/site-packages/torch/c10d.py",
                        "line": 10},
                       {"name": "<module>", "filename": JOB, "line": 100 + rid}]
    return e


class FakeTorch:
    """What the writer calls of torch: a recorder whose ring the test sets."""

    def __init__(self) -> None:
        self.ring: list[dict[str, Any]] = []
        self.calls: list[bool] = []
        self._C = SimpleNamespace(_distributed_c10d=SimpleNamespace(_dump_fr_trace=self._dump))

    def _dump(self, includeStackTraces: bool) -> bytes:  # torch's keyword
        self.calls.append(includeStackTraces)
        entries = [dict(e) if includeStackTraces else
                   {k: v for k, v in e.items() if k != "frames"} for e in self.ring]
        top = max((e["collective_seq_id"] for e in self.ring), default=-1)
        return pickle.dumps({"entries": entries, "pg_status": {"0": {
            "last_enqueued_collective": top, "last_completed_collective": top,
            "last_started_collective": -1}}})


def _history(path: Path, torch: Any, max_bytes: int = appendlog.MAX_BYTES
             ) -> history.History:
    lock = threading.Lock()

    @contextlib.contextmanager
    def within(timeout: float | None = None) -> Iterator[Any]:
        if not lock.acquire(timeout=-1 if timeout is None else timeout):
            yield None
            return
        try:
            yield torch
        finally:
            lock.release()

    return history.History(appendlog.PostedLog(path, max_bytes), within,
                           {"kind": "start", "pid": 1, "rank": 0})


def _status(top: int) -> dict[str, Any]:
    return {"0": {"enqueued": top, "completed": top, "started": -1}}


def test_the_log_keeps_what_the_ring_dropped_and_says_where_it_lost_some(tmp_path: Path):
    torch = FakeTorch()
    path = tmp_path / "rank0.posted.jsonl"
    h = _history(path, torch)
    torch.ring = [_entry(i, frames=True) for i in range(10)]
    assert h.tick(_status(10), stacks=False) is not None
    assert h.tick(_status(10), stacks=False) is None  # nothing posted since: no copy
    torch.ring = [_entry(i, frames=True) for i in range(15, 21)]  # 10..14 fell out
    h.cost = 0.0
    assert h.tick(_status(21), stacks=False) is not None
    h.last_gasp("abort")  # with frames: every entry still in the ring again, with them
    log = read_posted_log(path)
    assert log is not None and not log.notes
    assert [c.record_id for c in log.collectives] == [*range(10), *range(15, 21)]
    assert log.gaps == [(10, 14)]
    assert log.end == "abort"
    assert torch.calls == [False, False, True]
    # the ring's last entries gained their call site; the earlier ones keep none
    assert [f.line for f in log.collectives[-1].frames if f.file == JOB] == [120]
    assert not log.collectives[0].frames
    assert all(c.source == "posted_log" and c.completed for c in log.collectives)


def test_a_copy_is_spaced_by_what_the_last_one_cost(tmp_path: Path):
    torch = FakeTorch()
    h = _history(tmp_path / "log", torch)
    torch.ring = [_entry(0)]
    assert h.tick(_status(1), stacks=False) is not None
    torch.ring.append(_entry(1))
    h.cost = 10.0  # a copy of a huge ring: the next one not before 100 × that
    assert h.tick(_status(2), stacks=False) is None
    assert h.tick(_status(2), stacks=False, force=True) is not None


def test_the_posting_threads_name_survives_the_thread(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch):
    torch = FakeTorch()
    h = _history(tmp_path / "log", torch)
    seen: dict[str, str] = {}
    start = threading.Thread.start  # threading's own (put back after the test)
    monkeypatch.setattr(threading.Thread, "start", getattr(start, "_moe_hang_real", start))
    h.thread_names.follow()

    def post() -> None:
        seen["tid"] = str(threading.get_ident())

    t = threading.Thread(target=post, name="grad-sync")
    t.start()
    t.join()
    main = str(threading.main_thread().ident)
    torch.ring = [{**_entry(0, tid=seen["tid"]), "time_created_ns": 2**62},
                  _entry(1, tid=main), _entry(2, tid="999")]
    h.tick(_status(3), stacks=False)
    log = read_posted_log(tmp_path / "log")
    assert log is not None
    assert [(c.thread_id, c.thread_name) for c in log.collectives] == [
        (seen["tid"], "grad-sync"), (main, "MainThread"), ("999", "python")]


def test_a_thread_id_reused_by_a_later_thread_names_each_entry_by_its_time():
    names = history.ThreadNames()
    names.saw(7, "loader", 100)
    names.saw(7, "grad-sync", 200)  # a new thread on the same pthread id
    assert [names.name("7", t) for t in (150, 250, None)] == ["loader", "grad-sync",
                                                              "grad-sync"]


def test_the_file_keeps_its_newest_half_with_the_stacks_it_needs(tmp_path: Path):
    torch = FakeTorch()
    path = tmp_path / "log"
    h = _history(path, torch, max_bytes=20_000)
    for step in range(40):
        torch.ring = [_entry(i, frames=True) for i in range(step * 10, step * 10 + 10)]
        h.tick(_status(step * 10 + 10), stacks=True, force=True)
    assert path.stat().st_size < 2 * 20_000
    log = read_posted_log(path)
    assert log is not None and not log.notes
    ids = [c.record_id for c in log.collectives]
    assert ids == list(range(ids[0], 400)) and ids[0] > 0
    assert log.gaps and log.gaps[0][1] == ids[0] - 1  # the trimmed part, said
    assert all(c.frames for c in log.collectives)  # every kept entry finds its stack


def test_the_reader_skips_a_torn_last_line_and_notes_garbage():
    stack = {"kind": "stack", "id": "s1", "frames": [[JOB, 5, "<module>"]]}
    lines = [
        {"kind": "start", "pid": 1},
        {"kind": "entry", **_entry(0), "process_group": ["0", "default_pg"]},  # an old run
        {"kind": "start", "pid": 2},
        stack,
        {"kind": "entry", **_entry(0), "process_group": ["0", "default_pg"]},
        {"kind": "entry", **_entry(1), "process_group": ["0", "default_pg"]},
        {"kind": "entry", **_entry(1), "process_group": ["0", "default_pg"], "stack": "s1"},
        {"kind": "gap", "from": 2, "to": 4, "why": "ring"},
        {"kind": "entry", **_entry(5, retired=False),
         "process_group": ["0", "default_pg"]},
        {"kind": "status", "pg": {"0": [6, 5, -1]}},
        {"kind": "end", "reason": "exception"},
        {"kind": "end", "reason": "exit"},
    ]
    text = b"".join(json.dumps(x).encode() + b"\n" for x in lines)
    text += b"not json\n[1, 2]\n{\"kind\": \"entry\", \"record_id\": \"x\"}\n"
    text += b'{"kind": "entry", "record_id": 9, "pg_'  # torn: killed mid-write
    log = parse_posted_log(text)
    assert [c.record_id for c in log.collectives] == [0, 1, 5]
    assert [f.line for f in log.collectives[1].frames] == [5]  # superseded: with frames
    assert log.gaps == [(2, 4)]
    assert log.end == "exception"  # the first end says how
    assert log.notes == ["3 unreadable line(s) in its posted log"]
    assert log.collectives[-1].completed is False
    assert parse_posted_log(b"").collectives == []
    assert parse_posted_log(b"\x00\xff garbage").notes == []  # only a torn "last line"


def _aborted_rank_1(tmp_path: Path) -> RunLayout:
    """A run directory whose rank 1 posted five collectives and was aborted: only its log."""
    layout = RunLayout(tmp_path / "run")
    layout.ranks_dir.mkdir(parents=True)
    torch = FakeTorch()
    h = _history(layout.rank(1).posted, torch)
    torch.ring = [_entry(i, frames=True) for i in range(5)]
    h.last_gasp("abort")
    return layout


def test_a_rank_without_a_dump_gets_its_history_from_the_log(tmp_path: Path):
    layout = _aborted_rank_1(tmp_path)
    (layout.rank(2).posted).write_bytes(b"\x00garbage\nmore garbage\n")
    ev = load_capture(layout.root)
    assert [c.seq for c in ev.ranks[1].posted_log] == [1, 2, 3, 4, 5]
    assert ev.ranks[1].log_end == "abort" and ev.ranks[1].log_gaps == []
    assert ev.ranks[2].posted_log == [] and ev.ranks[2].notes == [
        "2 unreadable line(s) in its posted log"]
    (last,) = [c for c in ev.ranks[1].posted_log if c.seq == 5]
    assert last.thread_name == "python" and (last.frames[-1].file, last.frames[-1].line) == \
        (JOB, 104)


def test_the_analysis_reads_an_aborted_ranks_history_from_its_log(tmp_path: Path):
    """gloo aborted rank 1 before its recorder could be dumped (its saved copy is older than
    its last collectives): the timeline has what its log kept, frames and counts with it."""
    from moe_hang.analysis.timeline import timeline

    ev = load_capture(_aborted_rank_1(tmp_path).root)
    r = ev.ranks[1]
    r.fr, r.fr_saved = fr.FRDump(entries=[], pg_status={}), True  # saved before any entry
    tl = timeline(r)
    assert sorted(tl.by_pg["0"]) == [1, 2, 3, 4, 5]
    assert all(c.frames for c in tl.by_pg["0"].values())
    assert tl.enqueued["0"] == 5


def test_a_log_cut_for_another_node_keeps_its_newest_part_as_the_probe_trims(tmp_path: Path):
    """What a node sends of a long log (capture/bundle.py): the newest entries whole, with
    the frames they use, the counts, the last gasp, and a gap for what was left out; the
    process's start record first, an earlier process's records not at all."""
    torch = FakeTorch()
    old = _history(tmp_path / "log", torch)
    torch.ring = [_entry(i) for i in range(50)]
    old.last_gasp("exit", stacks=False)  # an earlier process of the rank (a restart)
    h = _history(tmp_path / "log", torch)
    torch.ring = [_entry(i, frames=i % 7 == 0) for i in range(2000)]
    h.last_gasp("exception")
    data = (tmp_path / "log").read_bytes()
    whole = parse_posted_log(data)
    assert tail(data, len(data)) == data
    cut = tail(data, len(data) // 4)
    assert len(cut) <= len(data) // 4 + 4096
    got = parse_posted_log(cut)
    assert not got.notes and got.end == "exception" and got.status == whole.status
    seqs = [c.seq for c in got.collectives]
    assert seqs == list(range(seqs[0], 2001)) and 1000 < seqs[0] < 2000
    assert got.gaps == [(0, seqs[0] - 2)]  # record ids: seq - 1
    framed = {c.seq: c.frames for c in whole.collectives if c.frames}
    assert {c.seq: c.frames for c in got.collectives if c.frames} == \
        {q: f for q, f in framed.items() if q >= seqs[0]}


def test_real_recorder_dumps_name_the_posting_thread():
    dump = fr.load(FIXTURES / "eval_pending_save" / "ranks" / "rank0.fr.pkl")
    assert dump.entries and all(c.thread_id and c.thread_id.isdigit() and
                                c.thread_name == "python" for c in dump.entries)


def test_frames_wait_until_the_jobs_own_import_of_dynamo_is_whole(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Symbolizing imports torch._inductor: from the probe's thread while the job's is still
    importing torch._dynamo, one of them got a half-made module (an ImportError in the job)."""
    import importlib.machinery
    import types

    from moe_hang.probe.probe import Probe

    monkeypatch.delenv("MOE_HANG_FR_STACKS", raising=False)
    mod = types.ModuleType("torch._dynamo")
    mod.__spec__ = importlib.machinery.ModuleSpec("torch._dynamo", None)
    monkeypatch.setitem(sys.modules, "torch._dynamo", mod)
    probe = Probe(tmp_path, 0, 1.0)
    mod.__spec__._initializing = True  # type: ignore[attr-defined]
    assert not probe._want_stacks()
    mod.__spec__._initializing = False  # type: ignore[attr-defined]
    assert probe._want_stacks()


def test_a_forked_child_never_writes_the_ranks_log(tmp_path: Path):
    """A DataLoader worker forked from the rank inherits the probe and leaves by os._exit."""
    import os

    torch = FakeTorch()
    h = _history(tmp_path / "log", torch)
    torch.ring = [_entry(0)]
    h.tick(_status(1), stacks=False)
    before = (tmp_path / "log").read_bytes()
    torch.ring.append(_entry(1))
    pid = os.fork()
    if pid == 0:  # the child: whatever happens, it leaves at once
        try:
            h.last_gasp("os_exit")
            h.tick(_status(2), stacks=False, force=True)
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert status == 0 and (tmp_path / "log").read_bytes() == before
