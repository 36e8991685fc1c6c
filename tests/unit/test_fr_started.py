"""Recorder dumps of a symmetric hardware hang with TORCH_NCCL_ENABLE_TIMING=1
(tests/unit/fixtures/fr_started, written by scripts/fr_symmetric_hang.py on fr_synth's
build_dump): every rank ``started`` the same collective, none ``completed`` it. The fixtures
are what the recorder reader will need to keep ``state`` and its times for (docs/
nccl_evidence.md); today's verdict on them is checked too."""

from __future__ import annotations

import importlib.util
import json
import pickle
import sys

import pytest
from conftest import FIXTURES, ROOT

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


def test_the_generator_writes_exactly_these_fixtures(tmp_path):
    spec = importlib.util.spec_from_file_location("fr_symmetric_hang",
                                                  ROOT / "scripts" / "fr_symmetric_hang.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("fr_symmetric_hang", mod)
    spec.loader.exec_module(mod)
    for form in ("json", "pickle"):
        assert mod.main([str(tmp_path / form), "--format", form]) == 0
        for p in (SET / form).iterdir():
            assert (tmp_path / form / p.name).read_bytes() == p.read_bytes(), p


@pytest.mark.parametrize("form", ["json", "pickle"])
def test_todays_verdict_a_hang_with_no_culprit(form):
    d = analyze_paths([SET / form], force=False)
    assert d.verdict == "hang" and d.culprit_ranks == []
    assert {(r.collective.pg, r.collective.seq) for r in d.ranks if r.collective} == \
        {("0", TRUTH["seq"])}
