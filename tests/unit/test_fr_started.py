"""Recorder dumps of a symmetric hardware hang (tests/unit/fixtures/fr_started, written by
``scripts/fr_synth.py --fault stall``): every rank posted the same collective and none
completed it; with TORCH_NCCL_ENABLE_TIMING=1 (``json``, ``pickle``) every rank's kernel
``started`` it, without (``no_timing``) they are all ``scheduled``. The reader keeps the
states and times; the generator reproduces the fixtures byte for byte."""

from __future__ import annotations

import json
import pickle
import re

import pytest
from conftest import FIXTURES

from moe_hang.commands.diagnose import analyze_paths

SET = FIXTURES / "fr_started"
TRUTH = json.loads((SET / "json" / "truth.json").read_text())


def _dumps(form: str) -> dict[int, dict]:
    out = {}
    for p in sorted((SET / form).glob("comm_lib_trace_rank_*")):
        rank = int(p.name.split("_")[-1].split(".")[0])
        out[rank] = json.loads(p.read_text()) if form == "json" else pickle.loads(p.read_bytes())
    return out


@pytest.mark.parametrize("form", ["json", "pickle"])
def test_every_rank_started_the_same_collective_and_none_completed_it(form):
    dumps = _dumps(form)
    assert sorted(dumps) == [0, 1, 2, 3]
    seq = TRUTH["seq"]
    none = 0 if form == "json" else None  # JSON writes a missing time as 0, pickle None
    for rank, d in dumps.items():
        started = [e for e in d["entries"] if e["state"] == "started"]
        assert [(e["process_group"][0], e["collective_seq_id"]) for e in started] == \
            [("0", seq)], rank
        (s,) = started
        assert s["time_discovered_started_ns"] > s["time_created_ns"]
        assert s["time_discovered_completed_ns"] == none and "duration_ms" not in s
        assert not s["retired"]
        i = d["entries"].index(s)
        before, after = d["entries"][:i], d["entries"][i + 1:]
        assert before and all(e["state"] == "completed" and e["retired"] for e in before)
        for e in before:  # timing: every completed op has its start, completion and duration
            assert e["time_created_ns"] < e["time_discovered_started_ns"] \
                < e["time_discovered_completed_ns"]
            assert e["duration_ms"] > 0
        assert [e["state"] for e in after] == ["scheduled"]  # the loss all-reduce, enqueued
        st = {k: int(v) for k, v in d["pg_status"]["0"].items()}
        assert st == {"last_enqueued_collective": seq + 1, "last_started_collective": seq,
                      "last_completed_collective": seq - 1}


# how each fixture set was written (scripts/fr_synth.py)
WRITTEN_BY = {
    "json": ["--format", "json", "--timing"],
    "pickle": ["--format", "pickle", "--timing"],
    "no_timing": ["--format", "json"],
}


@pytest.mark.parametrize("form", sorted(WRITTEN_BY))
def test_the_generator_writes_exactly_these_fixtures(tmp_path, form):
    from moe_hang.testing.fr_synth import main

    args = [str(tmp_path / form), "--ranks", "4", "--mesh", "2x2", "--entries", "16",
            "--fault", "stall", "--seed", "0", "--workers", "1", *WRITTEN_BY[form]]
    assert main(args) == 0
    names = sorted(p.name for p in (SET / form).iterdir())
    assert names == sorted(p.name for p in (tmp_path / form).iterdir())
    for name in names:
        assert (tmp_path / form / name).read_bytes() == (SET / form / name).read_bytes(), name


def test_without_timing_every_rank_posted_it_and_none_started_or_completed_it():
    from moe_hang.evidence.flight_recorder import load

    truth = json.loads((SET / "no_timing" / "truth.json").read_text())
    assert truth["state"] == "scheduled" and truth["seq"] == TRUTH["seq"]
    for p in sorted((SET / "no_timing").glob("comm_lib_trace_rank_*")):
        d = load(p)
        assert not d.timing
        head = next(c for c in d.entries if (c.pg, c.seq) == ("0", truth["seq"]))
        assert head.state == "scheduled" and head.completed is False and not head.started


@pytest.mark.parametrize("form", ["json", "pickle", "no_timing"])
def test_the_verdict_is_a_transport_hang_with_no_culprit(form):
    d = analyze_paths([SET / form], force=False)
    assert d.verdict == "transport_hang" and d.culprit_ranks == []
    assert d.rule == "transport or hardware hang" and d.certainty == "uncertain"  # no RAS
    assert {(r.collective.pg, r.collective.seq) for r in d.ranks if r.collective} == \
        {("0", TRUTH["seq"])}
    assert ("TORCH_NCCL_ENABLE_TIMING=1" in d.summary) == (form == "no_timing")
    for text in (d.summary, d.fix):  # never called a code bug
        assert not re.search(r"\b(code|bug)\b", text, re.I), text


# ----------------------------------------------------------------------------- the reader


@pytest.mark.parametrize("form", ["json", "pickle"])
def test_the_reader_keeps_states_times_and_the_last_started_collective(form):
    from moe_hang.evidence.flight_recorder import load

    seq = TRUTH["seq"]
    for p in sorted((SET / form).glob("comm_lib_trace_rank_*")):
        d = load(p)
        assert d.timing
        by = {(c.pg, c.seq): c for c in d.entries}
        head = by[("0", seq)]
        assert head.state == "started" and head.started and head.completed is False
        assert head.time_started_ns is not None and head.time_started_ns > 0
        assert head.time_completed_ns is None and head.duration_ms is None  # JSON's 0 too
        done = [c for c in d.entries if c.completed]
        assert done and all(c.state == "completed" and c.started and c.duration_ms
                            and c.time_completed_ns for c in done)
        after = by[("0", seq + 1)]
        assert after.state == "scheduled" and not after.started
        assert d.pg_status["0"].started == seq
        assert d.pg_status["0"].completed == seq - 1


def test_without_timing_nothing_is_started_and_missing_times_are_none():
    from moe_hang.evidence.flight_recorder import loads

    entry = {"record_id": 0, "pg_id": 0, "process_group": ["0", "default_pg"],
             "collective_seq_id": 1, "p2p_seq_id": 0, "op_id": 1,
             "profiling_name": "nccl:all_reduce", "time_created_ns": 5,
             "input_sizes": [[1]], "input_dtypes": ["Float"], "output_sizes": [[1]],
             "output_dtypes": ["Float"], "state": "scheduled",
             "time_discovered_started_ns": 0, "time_discovered_completed_ns": 0,
             "retired": False, "timeout_ms": 1, "is_p2p": False}
    raw = json.dumps({"version": "2.10", "comm_lib_version": "2.27.5",
                      "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": "[0]"}},
                      "pg_status": {"0": {"last_enqueued_collective": "1",
                                          "last_started_collective": "-1",
                                          "last_completed_collective": "0"}},
                      "entries": [entry]}).encode()
    d = loads(raw)
    (c,) = d.entries
    assert c.state == "scheduled" and not c.started and c.completed is False
    assert c.time_started_ns is None and c.time_completed_ns is None
    assert d.pg_status["0"].started == -1 and not d.timing


def test_a_coalesced_op_is_as_far_as_its_least_advanced_member():
    from moe_hang.evidence.flight_recorder.parse_entry import _merge_coalesced
    from moe_hang.evidence.flight_recorder.records import Collective

    a = Collective("0", 3, "all_reduce", "nccl:all_reduce", state="completed",
                   time_started_ns=10, time_completed_ns=20, duration_ms=1.0, completed=True)
    b = Collective("0", 3, "all_reduce", "nccl:all_reduce", state="started", time_started_ns=12)
    m = _merge_coalesced([a, b])
    assert m.state == "started" and m.time_started_ns == 12 and m.time_completed_ns is None
    assert m.duration_ms is None and m.coalesced == 2


def test_the_probe_keeps_states_and_times_of_pending_entries():
    from moe_hang.evidence.probe_records import parse_pg_status
    from moe_hang.probe import sample

    for k in ("state", "time_discovered_started_ns", "time_discovered_completed_ns",
              "duration_ms"):
        assert k in sample._PENDING_KEYS
    st = parse_pg_status({"0": {"enqueued": 5, "completed": 3, "started": 4},
                          "1": {"enqueued": 2, "completed": 2}})
    assert st is not None and st["0"].started == 4 and st["1"].started == -1
