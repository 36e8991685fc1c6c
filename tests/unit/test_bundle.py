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




def test_the_job_logs_end_however_long_the_job_ran(tmp_path: Path) -> None:
    """torchrun's failure report is at the log's end: past 64 MiB as well (a sparse file)."""
    layout = _node(tmp_path, 5)
    with open(layout.job_log, "wb") as f:
        f.seek(70 << 20)
        f.write(b"\nRoot Cause (first observed failure):\nlast line\n")
    log = bundle.pack(layout, [2, 3])["files"]["job.log"]
    assert log.endswith("last line\n") and len(log) <= bundle.LOG_TAIL


def test_a_node_of_eight_big_ranks_stays_within_its_budget(tmp_path: Path) -> None:
    """Eight ranks with full rings (frames and all) and 4 MiB posted logs: the capture's text
    stays within the budget and decodes under the channel's cap; the probe's saved recorder
    is not sent where the loader would not read it (a dump at capture); what did not fit is
    named, and said on the rank."""
    layout = _node(tmp_path, 2000)
    ranks = list(range(8))
    for r in ranks:
        files = layout.rank(r)
        files.heartbeat.write_text(json.dumps({"rank": r, "world": 8}))
        files.fr.write_bytes(layout.rank(2).fr.read_bytes())
        files.fr_saved.write_bytes(layout.rank(2).fr.read_bytes())
        files.posted.write_text(json.dumps({"kind": "start", "pid": 1}) + "\n" + "".join(
            json.dumps({"kind": "entry", "record_id": i, "pg_id": 0, "collective_seq_id": i,
                        "profiling_name": "gloo:all_reduce", "pad": "x" * 200}) + "\n"
            for i in range(16000)))
    layout.rank(5).stack.write_text("x" * (bundle.TEXT_MAX + 1))
    data = bundle.pack(layout, ranks)
    text = sum(len(t) for got in data["ranks"].values() for t in got.values())
    assert text <= bundle.BUDGET
    wire = encode(data)
    assert decode(wire) is not None and len(json.dumps(data)) < 64 << 20
    assert all("fr.saved.pkl" not in got and "fr.pkl" in got and "posted.jsonl" in got
               for got in data["ranks"].values())
    assert data["left_out"] == {"5": ["stack.txt"]}
    from moe_hang.commands.multinode.summaries import merge_remote
    from moe_hang.evidence.model import Evidence
    from moe_hang.runtime.coord.summary import NodeSummary

    ev = Evidence(ranks={}, world_size=8)
    merge_remote(ev, {"1": NodeSummary("1", "vm", capture=data)}, into=tmp_path / "nodes")
    assert any("left out of its node's capture" in n and "stack.txt" in n
               for n in ev.ranks[5].notes), ev.ranks[5].notes


def test_a_malformed_capture_from_another_node_never_ends_the_round(tmp_path: Path) -> None:
    """Another node's files are input: bad ones are noted on the rank (or the node falls back
    to its heartbeats), ranks outside the job are not written, nothing raises."""
    from moe_hang.commands.multinode.summaries import merge_remote
    from moe_hang.evidence.model import Evidence
    from moe_hang.runtime.coord.summary import NodeSummary

    deep = "[" * 100_000 + "]" * 100_000
    data = {"version": bundle.VERSION, "files": {"source.json": deep},
            "ranks": {"2": {"hb.json": deep, "groups.json": '{"0": ["a", {}]}',
                            "stacks/pyspy.json": '[{"frames": 5}]', "fr.pkl": "{not json"},
                      "3": {"hb.json": json.dumps({"rank": 3, "world": 4})},
                      "²": {"hb.json": "{}"}, "9" * 5000: {"hb.json": "{}"},
                      "7": {"hb.json": "{}"}}}
    ev = Evidence(ranks={}, world_size=4)
    hb = NodeSummary("1", "vm", capture=data)
    assert merge_remote(ev, {"1": hb}, into=tmp_path / "nodes") == [2, 3]
    assert sorted(p.name for p in (tmp_path / "nodes" / "1" / "ranks").iterdir()) == [
        "rank2.fr.pkl", "rank2.groups.json", "rank2.hb.json", "rank3.hb.json"]
    assert ev.ranks[2].fr is None and ev.ranks[2].fr_error
    assert any("heartbeat unreadable" in n for n in ev.ranks[2].notes)


def test_a_link_where_the_capture_goes_is_not_followed(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    nodes = tmp_path / "nodes"
    nodes.mkdir()
    (nodes / "1").symlink_to(elsewhere)
    data = {"version": bundle.VERSION, "files": {}, "ranks": {"2": {"hb.json": "{}"}}}
    assert bundle.unpack(data, nodes / "1") is None
    assert list(elsewhere.iterdir()) == []
    linked = tmp_path / "linked"
    linked.symlink_to(elsewhere)
    assert bundle.unpack(data, linked / "1") is None and list(elsewhere.iterdir()) == []


def test_analyze_takes_the_kept_captures_of_its_own_rounds_verdict_only(tmp_path: Path) -> None:
    """A later round another node analysed leaves this node's ``coord/nodes/`` of an earlier
    round: those are not what its verdict came from."""
    root = RunLayout(tmp_path / "run")
    dest = bundle.node_dir(root.coord_nodes, "1")
    assert dest is not None
    assert bundle.unpack({"version": bundle.VERSION, "files": {},
                          "ranks": {"2": {"hb.json": "{}"}}}, dest) is not None
    root.coord_nodes_round.write_text(json.dumps({"request": "r1"}))
    root.coord_verdict.write_text(json.dumps({"request": "r1"}))
    assert root.node_captures() == [dest]
    root.coord_verdict.write_text(json.dumps({"request": "r2"}))
    assert root.node_captures() == []


def test_an_earlier_attempts_failure_report_is_not_this_process_exit(tmp_path: Path) -> None:
    """torchrun restarted the ranks: its report of the earlier attempt's rank 1 (another pid)
    is not the exit code of the rank alive now."""
    layout = RunLayout(tmp_path / "run")
    layout.ranks_dir.mkdir(parents=True)
    layout.rank(1).heartbeat.write_text(json.dumps({"rank": 1, "pid": 222, "world": 2,
                                                    "restart": 1}))
    layout.job_log.write_text("Failures:\n[1]:\n  time      : now\n  host      : vm\n"
                              "  rank      : 1 (local_rank: 1)\n"
                              "  exitcode  : -9 (pid: 111)\n")
    assert load_capture(layout.root).ranks[1].exit_code is None
    layout.rank(1).heartbeat.write_text(json.dumps({"rank": 1, "pid": 111, "world": 2,
                                                    "restart": 1}))
    assert load_capture(layout.root).ranks[1].exit_code == -9
    # one attempt: the report's pid may be a wrapper's (torchrun runs a shell script)
    layout.rank(1).heartbeat.write_text(json.dumps({"rank": 1, "pid": 222, "world": 2}))
    assert load_capture(layout.root).ranks[1].exit_code == -9


def test_analyze_of_one_nodes_directory_leaves_the_other_nodes_ranks_unknown(
        tmp_path: Path) -> None:
    """One node's run directory of a multi-node watch, alone: the ranks of the world it does
    not hold are unknown — their capture is elsewhere, never "absent", never blamed — and
    the sentence says why (not "no watcher answered": every watcher did)."""
    from moe_hang.commands.diagnose import analyze_paths

    layout = _node(tmp_path, 5)  # ranks 2, 3 of a world of 4
    layout.processes.write_text(json.dumps({"world_size": 4, "job": "stalled",
                                            "ranks": {"2": {"alive": True},
                                                      "3": {"alive": True}}}))
    for r in (2, 3):
        layout.rank(r).heartbeat.write_text(json.dumps(
            {"rank": r, "pid": 10 + r, "world": 4, "local_world": 2, "time": 1.0}))
    layout.coord_dir.mkdir()
    layout.coord_verdict.write_text(json.dumps({"request": "r1",
                                                "hosts": {"0": "vm-a", "1": "vm-b"}}))
    d = analyze_paths([layout.root], force=False).to_dict()
    unknown = {r["rank"]: r for r in d["ranks"] if r["state"] == "unknown"
               and r.get("note") in ("node 0: not in the captures given",
                                     "node 1: not in the captures given")}
    assert sorted(unknown) == [0, 1] and not set(d["culprit_ranks"]) & {0, 1}
    assert unknown[0]["note"] == "node 0: not in the captures given"
    assert "no watcher answered" not in json.dumps(d)
