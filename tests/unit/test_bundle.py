"""A node's capture as it crosses to the node that analyses (moe_hang/capture/bundle.py):
bounded, read back by the same loader, and written only where and as it should be."""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import pytest

from moe_hang.capture import bundle
from moe_hang.evidence.load import load_capture
from moe_hang.probe.layout import RunLayout
from moe_hang.runtime.coord.codec import decode, encode


def _entry(rid: int) -> dict[str, Any]:
    return {"record_id": rid, "pg_id": 0, "process_group": ("0", "default_pg"),
            "collective_seq_id": rid + 1, "p2p_seq_id": -1, "op_id": rid + 1,
            "profiling_name": "gloo:all_reduce", "time_created_ns": 10 + rid,
            "input_sizes": [[4]], "input_dtypes": ["Float"], "output_sizes": [[4]],
            "output_dtypes": ["Float"], "state": "completed", "retired": True,
            "is_p2p": False, "thread_id": "7", "thread_name": "python",
            "frames": [{"name": "<module>", "filename": "/job/train.py", "line": 100 + rid % 5}]}


def _node(tmp: Path, entries: int) -> RunLayout:
    layout = RunLayout(tmp / "node1")
    layout.ranks_dir.mkdir(parents=True)
    for r in (2, 3):
        layout.rank(r).heartbeat.write_text(json.dumps({"rank": r, "pid": 10 + r, "world": 4,
                                                        "time": 1.0, "host": "vm-1"}))
        layout.rank(r).fr.write_bytes(pickle.dumps({
            "version": "2.10", "entries": [_entry(i) for i in range(entries)],
            "pg_status": {"0": {"last_enqueued_collective": entries,
                                "last_completed_collective": entries,
                                "last_started_collective": -1}}}))
    layout.job_log.write_text("".join(f"line {i}\n" for i in range(100_000)))
    return layout


def test_a_capture_travels_whole_and_reads_as_at_home(tmp_path: Path) -> None:
    layout = _node(tmp_path, 50)
    back = decode(encode(bundle.pack(layout, [2, 3])))  # as it travels
    there = bundle.unpack(back, tmp_path / "nodes" / "1")
    assert there is not None
    here_ev, there_ev = load_capture(layout.root), load_capture(there.root)
    for r in (2, 3):
        a, b = here_ev.ranks[r], there_ev.ranks[r]
        assert a.fr is not None and b.fr is not None
        assert [(c.seq, c.op, c.frames, c.thread_id) for c in a.fr.entries] == \
            [(c.seq, c.op, c.frames, c.thread_id) for c in b.fr.entries]
        assert a.fr.pg_status == b.fr.pg_status and a.heartbeat == b.heartbeat
    tail = (there.job_log).read_text()
    assert tail.endswith("line 99999\n") and tail.startswith("line ")
    assert len(tail) <= bundle.LOG_TAIL


def test_a_capture_past_its_budget_keeps_each_ranks_newest_collectives(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bundle, "BUDGET", 2 * (bundle.TEXT_MAX + 200_000))
    layout = _node(tmp_path, 5000)
    data = bundle.pack(layout, [2, 3])
    assert len(json.dumps(data)) < bundle.BUDGET
    there = bundle.unpack(data, tmp_path / "nodes" / "1")
    assert there is not None
    ev = load_capture(there.root)
    for r in (2, 3):
        dump = ev.ranks[r].fr
        assert dump is not None
        seqs = [c.seq for c in dump.entries]
        assert seqs == list(range(seqs[0], 5001)) and 1 < seqs[0] < 4900
        assert dump.pg_status["0"].completed == 5000


def test_a_bundle_from_the_channel_writes_only_its_own_files(tmp_path: Path) -> None:
    """A node's capture is input: a name that is not one of a capture's files, a rank that is
    no number, a node name that is a path, are not written anywhere."""
    from moe_hang.capture import bundle

    data = {"version": bundle.VERSION, "files": {"job.log": "x\n", "../evil": "x",
                                                  "meta.json": "{}"},
            "ranks": {"1": {"hb.json": "{}", "../../x": "y", "stacks/../z": "w",
                            "stacks/pyspy.json": "[]", "fr.pkl": 5},
                      "../2": {"hb.json": "{}"}}}
    assert bundle.node_dir(tmp_path, "..") is None
    assert bundle.node_dir(tmp_path, "a/b") is None
    dest = bundle.node_dir(tmp_path / "nodes", "1")
    assert dest is not None
    layout = bundle.unpack(data, dest)
    assert layout is not None
    written = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
    assert written == ["nodes/1/job.log", "nodes/1/ranks/rank1.hb.json",
                       "nodes/1/stacks/rank1.pyspy.json"]
    assert oct(dest.stat().st_mode & 0o777) == "0o700"
    assert bundle.unpack({"version": 99, "ranks": {}, "files": {}}, dest) is None


