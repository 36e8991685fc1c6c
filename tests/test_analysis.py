"""Analysis on recorded captures: pure, no processes."""

from __future__ import annotations

import json
import shutil

from moe_hang import analysis, collect, frtrace
from moe_hang.diagnosis import SCHEMA


def _diag(path, **kw):
    return analysis.diagnose(collect.load(path, **kw)).to_dict()


def _assert_schema(d):
    for key in ("schema", "verdict", "summary", "culprit_ranks", "first_divergence", "ranks",
                "fix", "artifacts"):
        assert key in d, key
    assert d["schema"] == SCHEMA
    for r in d["ranks"]:
        for key in ("rank", "pid", "host", "state", "collective", "callsite", "tokens",
                    "exit_code"):
            assert key in r, key
    json.dumps(d)  # serialisable


def test_size_mismatch_from_a_real_gloo_abort(fixtures):
    d = _diag(fixtures / "ragged_gloo")
    _assert_schema(d)
    assert d["verdict"] == "desync"
    fd = d["first_divergence"]
    assert (fd["pg"], fd["seq"], fd["kind"]) == ("0", 1, "size_mismatch")
    assert fd["per_rank"]["0"]["input_sizes"] == [[68, 64]]
    assert fd["per_rank"]["1"]["input_sizes"] == [[401, 64]]
    assert sorted(d["culprit_ranks"]) == [0, 1]  # no majority: both sizes are "wrong"
    by_rank = {r["rank"]: r for r in d["ranks"]}
    for r in (0, 1):
        assert by_rank[r]["callsite"]["function"] == "naive_gather"
        assert by_rank[r]["callsite"]["file"].endswith("moe_hang/ep.py")
        assert by_rank[r]["state"] == "exited"
    assert by_rank[0]["exit_code"] == -6 and by_rank[1]["exit_code"] == -15
    assert by_rank[0]["tokens"]["local"] == 68 and by_rank[1]["tokens"]["local"] == 401
    assert by_rank[0]["tokens"]["per_expert"] == [37, 37, 29, 33]
    assert any("Received data size" in line for line in d["evidence"])
    assert "68×64" in d["summary"] and "401×64" in d["summary"]


def test_op_mismatch_names_the_rank_that_skipped(fixtures):
    d = _diag(fixtures / "op_mismatch")
    _assert_schema(d)
    assert d["verdict"] == "desync"
    fd = d["first_divergence"]
    assert (fd["pg"], fd["seq"], fd["kind"]) == ("0", 1, "op_mismatch")
    assert fd["per_rank"]["0"]["op"] == "all_gather"
    assert fd["per_rank"]["1"]["op"] == "barrier"
    # rank 1 went on to the barrier (line 21) without the all-gather (line 20 -> 17)
    assert d["culprit_ranks"] == [1]
    by_rank = {r["rank"]: r for r in d["ranks"]}
    assert by_rank[0]["callsite"]["line"] == 17 and by_rank[0]["callsite"]["function"] == "dispatch"
    assert by_rank[1]["callsite"]["line"] == 21
    assert by_rank[0]["state"] == by_rank[1]["state"] == "in_collective"


def test_healthy_run(fixtures):
    d = _diag(fixtures / "healthy", job="completed")
    _assert_schema(d)
    assert d["verdict"] == "healthy"
    assert d["culprit_ranks"] == [] and d["first_divergence"] is None
    assert all(r["state"] == "exited" and r["exit_code"] == 0 for r in d["ranks"])
    assert {r["rank"]: r["tokens"]["gathered_lengths"] for r in d["ranks"]} == {
        0: [68, 401], 1: [68, 401]}


def test_corrupt_files_degrade_to_notes_not_crashes(fixtures, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(fixtures / "ragged_gloo", run)
    (run / "ranks" / "rank1.fr.pkl").write_bytes(b"\x80\x04garbage")
    (run / "ranks" / "rank0.hb.json").write_text('{"rank": 0, "pid"')
    with open(run / "ranks" / "rank0.tokens.jsonl", "a") as f:
        f.write('{"truncated": ')
    d = _diag(run)
    assert d["verdict"] == "desync"  # the probe records still show 68 vs 401
    assert any("Flight Recorder dump unreadable" in e for e in d["evidence"])
    assert any("unreadable line" in e for e in d["evidence"])


def test_restricted_unpickler_refuses_code():
    import pickle

    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    raw = pickle.dumps({"entries": [Evil()]})
    try:
        frtrace.loads(raw)
    except pickle.UnpicklingError as exc:
        assert "refusing global" in str(exc)
    else:
        raise AssertionError("a global in a dump was accepted")


def test_reads_torch_pickle_dump_of_gloo(fixtures):
    d = frtrace.load(fixtures / "op_mismatch" / "ranks" / "rank0.fr.pkl")
    assert d.backend == "gloo"
    assert [(c.pg, c.seq, c.op) for c in d.entries] == [("1", 1, "all_reduce"),
                                                        ("0", 1, "all_gather")]
    assert d.pg_status["0"] == {"enqueued": 1, "completed": -1}
    assert d.entries[1].frames[-1].function == "<module>"


def test_reads_torch_json_dump_format_by_rank_in_filename(fixtures):
    dumps, errors = frtrace.load_dir(fixtures / "fr_json")
    assert not errors and sorted(dumps) == [0, 1]
    assert [(c.seq, c.op) for c in dumps[1].entries if c.pg == "0"] == [(1, "barrier")]
    assert dumps[0].entries[0].input_sizes == [[4, 8]]
