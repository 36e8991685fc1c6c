"""`moe-hang analyze` on torch's own Flight Recorder dumps: finding them, reading every format,
post-mortem evidence, what the verdict says about real hung gloo jobs, and the refusals."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import time
from pathlib import Path

import psutil
import pytest
from conftest import FIXTURES, assert_no_survivors, make_fr_set, run_cli

from moe_hang.commands.diagnose import analyze_paths
from moe_hang.errors import MoeHangError
from moe_hang.evidence import flight_recorder as fr
from moe_hang.evidence.flight_recorder import PgStatus, load_sets, postmortem

REAL = FIXTURES / "fr_real"
PREFIX = "comm_lib_trace_rank_"
FORMS = {"world2_skip": ["pickle", "pickle_frames", "json"], "mesh4_skip": ["pickle", "json"],
         "p2p2": ["pickle", "json"]}
REAL_SETS = [(v, f) for v, forms in FORMS.items() for f in forms]


def make_set(out: Path, *args: str) -> dict:
    return make_fr_set(out, *args)


def planted(variant: str) -> dict:
    return json.loads((REAL / variant / "meta.json").read_text())["planted"]


def _one_line(exc: pytest.ExceptionInfo[MoeHangError]) -> str:
    text = str(exc.value)
    assert "\n" not in text and "Traceback" not in text, text
    return text


# ----------------------------------------------------------------------------- reading


@pytest.mark.parametrize("variant,form", REAL_SETS)
def test_every_real_dump_reads_as_gloo_2_10(variant, form):
    found = postmortem.find([REAL / variant / form])
    assert not found.problems and len(found.sets) == 1
    (ls,) = postmortem.load_sets(found.sets)
    assert not ls.problems
    assert sorted(ls.fr) == list(range(json.loads((REAL / variant / "meta.json").read_text())
                                       ["nproc"]))
    for d in ls.fr.values():
        assert (d.version, d.backend, d.lib_version) == ("2.10", "gloo", "")
        assert d.p2p == []  # gloo records no point-to-point
        assert all(bool(c.frames) == (form == "pickle_frames") for c in d.entries)


def test_pickle_and_json_of_one_dump_give_the_same_records():
    a = fr.load(REAL / "mesh4_skip" / "pickle" / f"{PREFIX}2")
    b = fr.load(REAL / "mesh4_skip" / "json" / f"{PREFIX}2.json")
    key = [(c.pg, c.seq, c.op, c.input_sizes, c.output_sizes, c.dtypes, c.completed, c.pg_desc,
            c.record_id) for c in a.entries]
    assert key == [(c.pg, c.seq, c.op, c.input_sizes, c.output_sizes, c.dtypes, c.completed,
                    c.pg_desc, c.record_id) for c in b.entries]
    assert a.pg_status == b.pg_status


def test_equal_stacks_of_a_load_share_one_frame_list_and_odd_frames_still_parse():
    from moe_hang.evidence.flight_recorder.parse import parse_dump
    from moe_hang.evidence.flight_recorder.parse_entry import RankLists

    def frames(line: int) -> list[dict]:  # a new object every time, as JSON decodes them
        return [{"name": "all_reduce", "filename": "/x/torch/distributed/c10d.py", "line": 9},
                {"name": "step", "filename": "/job/train.py", "line": line}]

    def dump(lines: list[int], odd: object = None) -> dict:
        entries = [{"record_id": i, "pg_id": 0, "process_group": ["0", "default_pg"],
                    "is_p2p": False, "collective_seq_id": i + 1,
                    "profiling_name": "gloo:all_reduce",
                    "input_sizes": [[4]], "output_sizes": [[4]], "input_dtypes": ["Float"],
                    "state": "completed", "frames": frames(line)}
                   for i, line in enumerate(lines)]
        if odd is not None:
            entries[-1]["frames"] = odd
        return {"version": "2.10", "pg_config": {"0": {"name": "0", "desc": "default_pg",
                                                        "ranks": "[0, 1]"}},
                "entries": entries}

    lists = RankLists()
    a = parse_dump(dump([12, 14, 12]), lists=lists)
    b = parse_dump(dump([12, 14], odd=[{"filename": ["?"], "line": 3, "name": "f"}]),
                   lists=lists)
    assert [c.frames[1].line for c in a.entries] == [12, 14, 12]
    assert a.entries[0].frames is a.entries[2].frames is b.entries[0].frames
    assert a.entries[1].frames is not a.entries[0].frames
    # sizes and dtypes likewise: one list per distinct value (compared by identity first)
    assert a.entries[0].input_sizes is b.entries[1].output_sizes == [[4]]
    assert a.entries[0].dtypes is b.entries[1].dtypes == ["Float"]
    assert b.entries[1].frames[0].file == "['?']"  # unhashable: parsed on its own
    alone = parse_dump(dump([12]))  # no shared table: its own
    assert alone.entries[0].frames == a.entries[0].frames
    assert alone.entries[0].frames is not a.entries[0].frames


def test_gloo_pg_status_is_read_in_sequence_numbers_not_op_counts():
    # rank 0 did send, batch isend/irecv between its collectives: gloo's pg_status counts
    # those ops (enqueued 6) though the barrier it waits in is collective 3
    raw = pickle.loads((REAL / "p2p2" / "pickle" / f"{PREFIX}0").read_bytes())
    assert raw["pg_status"]["0"]["last_enqueued_collective"] == 6
    r0 = fr.load(REAL / "p2p2" / "pickle" / f"{PREFIX}0")
    r1 = fr.load(REAL / "p2p2" / "pickle" / f"{PREFIX}1")
    assert r0.pg_status == {"0": PgStatus(enqueued=3, completed=2)}
    assert r1.pg_status == {"0": PgStatus(enqueued=2, completed=2)}  # it never posted seq 3
    assert [(c.seq, c.op, c.completed) for c in r0.entries] == [
        (1, "all_reduce", True), (2, "all_reduce", True), (3, "barrier", False)]


def test_gloo_pg_status_keyed_by_local_id_is_named_through_the_entries():
    # mesh4: pg_id 1 is a dp group (named "1" or "2"), pg_id 2 a tp group ("3" or "4")
    d = fr.load(REAL / "mesh4_skip" / "pickle" / f"{PREFIX}3")
    assert set(d.pg_status) == {"0", "2", "4"}
    assert d.pg_status["4"] == PgStatus(enqueued=1, completed=1)  # skipped tp seq 2
    assert d.pg_desc["4"] == "mesh_tp" and d.pg_desc["2"] == "mesh_dp"
    assert d.pg_ranks == {}  # gloo's pg_config is one "" entry


def test_ring_buffer_wrap_and_windowing():
    path = REAL / "world2_skip" / "pickle_frames" / f"{PREFIX}0"
    full = fr.load(path)
    assert full.window is not None and full.window.first_record_id == 14  # 16 of 30 kept
    assert [c.seq for c in full.entries] == list(range(15, 31))
    win = fr.load(path, context=2)
    assert [(c.seq, c.completed) for c in win.entries] == [(28, True), (29, True), (30, False)]
    assert win.window is not None and (win.window.total, win.window.kept) == (16, 3)
    pending = win.entries[-1]
    assert pending.op == "all_gather" and pending.frames[-1].function == "<module>"
    # frames are converted once per distinct stack, not per entry
    same = [c.frames for c in full.entries if c.op == "all_reduce"]
    assert len({id(f) for f in same}) < len(same)


def _nccl_dump(entries: list[dict], pg_config: dict, status: dict) -> dict:
    return {"version": "2.10", "pg_config": pg_config, "comm_lib_version": "2.27.5",
            "pg_status": status, "entries": entries}


def _entry(rid: int, pg: tuple[str, str], pg_id: int, seq: int, name: str, *, p2p_seq: int = 0,
           state: str = "completed", p2p: bool = False, sizes=((4,),)) -> dict:
    return {"record_id": rid, "pg_id": pg_id, "process_group": pg, "collective_seq_id": seq,
            "p2p_seq_id": p2p_seq, "op_id": rid + 1, "profiling_name": name,
            "time_created_ns": 10**18 + rid, "input_sizes": [list(s) for s in sizes],
            "input_dtypes": ["Float"] * len(sizes), "output_sizes": [list(s) for s in sizes],
            "output_dtypes": ["Float"] * len(sizes), "state": state,
            "time_discovered_started_ns": None, "time_discovered_completed_ns": None,
            "retired": state == "completed", "timeout_ms": 600000, "is_p2p": p2p}


def test_nccl_point_to_point_peers_are_mapped_to_global_ranks():
    # group "5" holds global ranks 4 and 12: NCCL names its p2p ops with local ranks 0 and 1
    cfg = {"0": {"name": "0", "desc": "default_pg", "ranks": str(list(range(16)))},
           "5": {"name": "5", "desc": "pipe", "ranks": "[4, 12]"}}
    pg = ("5", "pipe")
    entries = [
        _entry(0, pg, 1, 0, "nccl:send 0->1", p2p_seq=1, p2p=True),
        _entry(1, pg, 1, 0, "nccl:recv 0<-1", p2p_seq=2, p2p=True, state="scheduled"),
        _entry(2, ("0", "default_pg"), 0, 7, "nccl:send 4->9", p2p_seq=1, p2p=True,
               state="scheduled"),
    ]
    d = fr.parse_dump(_nccl_dump(entries, cfg, {"0": {"last_enqueued_collective": 6,
                                                           "last_started_collective": -1,
                                                           "last_completed_collective": 6}}))
    assert d.entries == []  # FRDump.entries holds collectives only
    assert [(p.op, p.peer, p.local_peer, p.pg, p.p2p_seq, p.completed) for p in d.p2p] == [
        ("send", 12, 1, "5", 1, True), ("recv", 12, 1, "5", 2, False),
        ("send", 9, 9, "0", 1, False)]


def test_coalesced_collectives_are_one_and_a_p2p_batch_is_marked():
    pg = ("1", "mesh_dp")
    entries = [
        _entry(0, pg, 1, 9, "nccl:_all_gather_base", sizes=((8,),), state="scheduled"),
        _entry(1, pg, 1, 9, "nccl:_all_gather_base", sizes=((16,),), state="scheduled"),
        _entry(2, pg, 1, 9, "nccl:ALLGATHER_coalesced", sizes=((8,), (16,)), state="scheduled"),
        _entry(3, ("0", "default_pg"), 0, 4, "nccl:send 0->1", p2p_seq=3, p2p=True),
        _entry(4, ("0", "default_pg"), 0, 4, "nccl:recv 0<-1", p2p_seq=3, p2p=True),
        _entry(5, ("0", "default_pg"), 0, 4, "nccl:coalesced", p2p_seq=3, p2p=True),
    ]
    cfg = {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1]"},
           "1": {"name": "1", "desc": "mesh_dp", "ranks": "[0, 1]"}}
    status = {"0": {"last_enqueued_collective": 4, "last_started_collective": -1,
                    "last_completed_collective": 4},
              "1": {"last_enqueued_collective": 9, "last_started_collective": -1,
                    "last_completed_collective": 8}}
    d = fr.parse_dump(_nccl_dump(entries, cfg, status))
    (c,) = d.entries
    assert (c.pg, c.seq, c.op, c.coalesced, c.completed) == ("1", 9, "all_gather", 2, False)
    assert c.input_sizes == [[8], [16]]
    assert [(p.op, p.batched) for p in d.p2p] == [("send", True), ("recv", True)]
    assert d.pg_status["1"] == PgStatus(enqueued=9, completed=8)


@pytest.mark.parametrize("release", ["2.4", "2.5", "2.6", "2.7", "2.8", "2.9", "2.10", "2.11",
                                     "2.12", "2.13"])
def test_every_release_format_gives_the_planted_verdict(tmp_path, release):
    truth = make_set(tmp_path / "s", "--ranks", "8", "--mesh", "2x4", "--entries", "30",
                     "--fault", "size", "--version", release)
    d = analyze_paths([tmp_path / "s"], force=False)
    fd = d.first_divergence
    assert d.verdict == "desync" and d.culprit_ranks == truth["culprits"]
    assert fd is not None and (fd.pg, fd.seq, fd.kind) == (truth["group"]["name"], truth["seq"],
                                                           "size_mismatch")


@pytest.mark.parametrize("release,backend", [("2.5", "nccl"), ("2.8", "gloo"), ("2.13", "gloo")])
def test_json_dumps_of_each_release(tmp_path, release, backend):
    truth = make_set(tmp_path / "s", "--ranks", "8", "--mesh", "2x4", "--entries", "30",
                     "--fault", "size", "--version", release, "--backend", backend,
                     "--format", "json")
    assert not list((tmp_path / "s").glob(f"{truth['prefix']}*[0-9]"))  # all .json
    d = analyze_paths([tmp_path / "s"], force=False)
    assert d.culprit_ranks == truth["culprits"]
    assert d.first_divergence is not None and d.first_divergence.seq == truth["seq"]


# ----------------------------------------------------------------------------- verdicts, real


@pytest.mark.parametrize("form", ["pickle", "json"])
def test_real_mesh_job_names_the_rank_that_skipped_its_tp_all_reduce(form):
    want = planted("mesh4_skip")
    d = analyze_paths([REAL / "mesh4_skip" / form], force=False)
    fd = d.first_divergence
    assert d.verdict == "desync" and d.culprit_ranks == want["culprits"]
    assert fd is not None and (fd.pg, fd.seq, fd.kind) == (want["pg"], want["seq"], want["kind"])
    assert sorted(r.rank for r in d.ranks) == [0, 1, 2, 3]


@pytest.mark.parametrize("form", ["pickle", "json", "pickle_frames"])
def test_real_world_job_names_the_collectives_that_differ(form):
    want = planted("world2_skip")
    d = analyze_paths([REAL / "world2_skip" / form], force=False)
    fd = d.first_divergence
    assert d.verdict == "desync"
    assert fd is not None and (fd.pg, fd.seq, fd.kind) == (want["pg"], want["seq"], want["kind"])
    if form != "pickle_frames":
        # one rank against one: without stacks nothing decides, both are named
        assert set(want["culprits"]) <= set(d.culprit_ranks)


@pytest.mark.parametrize("form", ["pickle", "json"])
def test_real_p2p_job_blames_the_rank_that_never_enqueued_the_barrier(form):
    want = planted("p2p2")
    d = analyze_paths([REAL / "p2p2" / form], force=False)
    fd = d.first_divergence
    assert d.culprit_ranks == want["culprits"]
    assert fd is not None and (fd.pg, fd.seq) == (want["pg"], want["seq"])
    # what the dumps cannot show is said, and how to see it
    assert "no collective pending" in d.summary and "gloo records no send/recv" in d.summary
    assert d.certainty == "uncertain" and "stack" in d.fix


# ----------------------------------------------------------------------------- naming a set


def test_a_prefix_a_file_and_a_shell_glob_name_the_same_set(tmp_path):
    src = REAL / "mesh4_skip" / "pickle"
    prefix = analyze_paths([src / PREFIX], force=False)
    files = analyze_paths(sorted(src.glob(f"{PREFIX}*")), force=False)
    assert prefix.culprit_ranks == files.culprit_ranks == [3]
    one = postmortem.find([src / f"{PREFIX}2"])
    assert [sorted(s.files) for s in one.sets] == [[2]]


def test_home_in_a_prefix_is_expanded(tmp_path, monkeypatch):
    cache = tmp_path / ".cache" / "torch"
    shutil.copytree(REAL / "mesh4_skip" / "pickle", cache)
    monkeypatch.setenv("HOME", str(tmp_path))
    found = postmortem.find([Path(f"~/.cache/torch/{PREFIX}")])
    assert [len(s.files) for s in found.sets] == [4] and not found.problems


def test_a_copy_that_keeps_the_rank_in_its_name_is_read(tmp_path):
    shutil.copy(REAL / "mesh4_skip" / "pickle" / f"{PREFIX}1", tmp_path / "rank1.fr.pkl")
    found = postmortem.find([tmp_path / "rank1.fr.pkl"])
    assert [sorted(s.files) for s in found.sets] == [[1]]


def test_pickle_and_json_of_the_same_rank_count_once(tmp_path):
    for p in (REAL / "p2p2" / "pickle").iterdir():
        shutil.copy(p, tmp_path / p.name)
    shutil.copy(REAL / "p2p2" / "json" / f"{PREFIX}1.json", tmp_path)
    found = postmortem.find([tmp_path])
    (s,) = found.sets
    assert sorted(s.files) == [0, 1] and s.files[1].path.suffix == ""
    assert [p.path.name for p in found.problems] == [f"{PREFIX}1.json"]


def test_fifo_beside_the_dumps_is_never_opened(tmp_path):
    for p in (REAL / "p2p2" / "pickle").iterdir():
        shutil.copy(p, tmp_path / p.name)
    os.mkfifo(tmp_path / f"{PREFIX}0.pipe")  # torch's TORCH_NCCL_DEBUG_INFO_PIPE_FILE
    os.mkfifo(tmp_path / f"{PREFIX}7")
    (s,) = postmortem.find([tmp_path]).sets
    assert sorted(s.files) == [0, 1]


# ----------------------------------------------------------------------------- post mortem


def test_dumped_ranks_are_stuck_and_absent_ones_are_named_missing(tmp_path):
    truth = make_set(tmp_path / "s", "--ranks", "16", "--mesh", "4x4", "--entries", "40",
                     "--fault", "missing_rank")
    for r in (5, 15):  # the highest rank too: the world comes from pg_config, not file names
        (tmp_path / "s" / f"{PREFIX}{r}").unlink()
    found = postmortem.find([tmp_path / "s"])
    ev = postmortem.evidence(postmortem.load_sets(found.sets))
    assert ev.job == "timed_out" and ev.world_size == 16 and sorted(ev.ranks) == list(range(16))
    for r, e in ev.ranks.items():
        if r in (5, 15):
            assert e.fr is None and e.alive is None and e.notes == [postmortem.NO_DUMP_NOTE]
        else:
            assert e.fr is not None and e.alive is True and e.progressed is False
            assert e.threads is None and e.host is None
    d = analyze_paths([tmp_path / "s"], force=False)
    assert d.culprit_ranks == truth["culprits"]
    assert any(postmortem.NO_DUMP_NOTE in line for line in d.evidence)


@pytest.mark.timeout(120)
def test_parallel_loading_equals_serial_and_shares_group_lists(tmp_path):
    make_set(tmp_path / "s", "--ranks", "32", "--mesh", "4x8", "--entries", "60",
             "--fault", "p2p")
    (s,) = postmortem.find([tmp_path / "s"]).sets
    started = time.time()
    (one,) = postmortem.load_sets([s], workers=1)
    (two,) = postmortem.load_sets([s], workers=2)
    assert sorted(one.fr) == sorted(two.fr) == list(range(32))
    for r in one.fr:
        a, b = one.fr[r], two.fr[r]
        assert (a.entries, a.p2p, a.pg_status, a.pg_ranks) == (b.entries, b.p2p, b.pg_status,
                                                               b.pg_ranks)
    worlds = {id(d.pg_ranks["0"]) for d in two.fr.values()}
    assert len(worlds) == 1  # one world list for every rank, not 32 copies
    # and one list per distinct stack, whichever worker parsed it
    stacks = [c.frames for d in two.fr.values() for c in (*d.entries, *d.p2p)]
    assert len({id(f) for f in stacks}) == len({tuple(f) for f in stacks})
    # the workers are gone (what other tests of this session left is theirs to answer for)
    assert [p for p in psutil.Process().children(recursive=True)
            if p.create_time() >= started - 0.5] == []


def test_windowed_and_full_reads_give_the_same_verdict(tmp_path):
    truth = make_set(tmp_path / "s", "--ranks", "16", "--mesh", "4x4", "--entries", "120",
                     "--fault", "dtype")
    (s,) = postmortem.find([tmp_path / "s"]).sets
    full = postmortem.load_sets([s], context=None)
    win = postmortem.load_sets([s], context=fr.DEFAULT_CONTEXT)  # as 8192 ranks' are read
    kept = sum(len(d.entries) for d in win[0].fr.values())
    assert kept < sum(len(d.entries) for d in full[0].fr.values()) / 3
    from moe_hang.analysis.rules import diagnose

    a, b = diagnose(postmortem.evidence(full)), diagnose(postmortem.evidence(win))
    assert a.culprit_ranks == b.culprit_ranks == truth["culprits"]
    assert a.first_divergence is not None and b.first_divergence is not None
    assert (a.first_divergence.pg, a.first_divergence.seq) == (
        b.first_divergence.pg, b.first_divergence.seq) == (truth["group"]["name"], truth["seq"])


def test_the_history_kept_is_as_long_as_the_budget_allows(tmp_path):
    """A small job's dumps are read whole (what its earlier steps posted is the history the
    ladder reads); only as many ranks as the budget is shared by keep DEFAULT_CONTEXT."""
    make_set(tmp_path / "s", "--ranks", "4", "--entries", "120", "--fault", "dtype")
    (s,) = postmortem.find([tmp_path / "s"]).sets
    (got,), (full,) = postmortem.load_sets([s]), postmortem.load_sets([s], context=None)
    assert {r: len(d.entries) for r, d in got.fr.items()} == {
        r: len(d.entries) for r, d in full.fr.items()}
    (short,) = postmortem.load_sets([s], context=fr.DEFAULT_CONTEXT)
    assert sum(len(d.entries) for d in short.fr.values()) < sum(
        len(d.entries) for d in full.fr.values()) / 3


# ----------------------------------------------------------------------------- bad input


def test_bad_files_are_reported_per_file_and_the_rest_is_analyzed(tmp_path):
    make_set(tmp_path / "s", "--ranks", "16", "--mesh", "4x4", "--entries", "40",
             "--fault", "size")
    d = tmp_path / "s"
    raw = (d / f"{PREFIX}3").read_bytes()
    (d / f"{PREFIX}3").write_bytes(raw[: len(raw) // 2])  # the writer died mid-dump

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    (d / f"{PREFIX}4").write_bytes(pickle.dumps({"version": "2.10", "entries": [Evil()]},
                                                protocol=2))
    (d / f"{PREFIX}6").write_text("hello")
    diag = analyze_paths([d], force=False)
    ev = " ".join(diag.evidence)
    assert "truncated or corrupt pickle" in ev and "refusing global posix.system" in ev
    assert "not a Flight Recorder dump" in ev
    by = {r.rank: r for r in diag.ranks}
    assert sorted(by) == list(range(16))


def test_nothing_readable_is_one_line(tmp_path):
    (tmp_path / "notes.txt").write_text("x")
    (tmp_path / f"{PREFIX}0").write_bytes(b"\x80\x02}q\x00(X")  # truncated
    (tmp_path / f"{PREFIX}1.json").write_text('{"version": "2.10", "entries": [')
    with pytest.raises(MoeHangError) as exc:
        analyze_paths([tmp_path], force=False)
    text = _one_line(exc)
    assert text.startswith("nothing to analyze") and f"{PREFIX}0: truncated" in text
    assert "truncated or corrupt JSON" in text


def test_a_directory_of_other_files_is_named_with_its_files(tmp_path):
    (tmp_path / "a.log").write_text("x")
    (tmp_path / "b.txt").write_text("y")
    with pytest.raises(MoeHangError) as exc:
        analyze_paths([tmp_path], force=False)
    text = _one_line(exc)
    assert "no Flight Recorder dump" in text and "a.log, b.txt" in text


def test_a_path_that_names_nothing(tmp_path):
    with pytest.raises(MoeHangError) as exc:
        analyze_paths([tmp_path / "nccl_trace_rank_"], force=False)
    assert "no dump named nccl_trace_rank_<rank>" in _one_line(exc)
    with pytest.raises(MoeHangError) as exc:
        analyze_paths([tmp_path / "nope" / "x"], force=False)
    assert "no such file or directory" in _one_line(exc)


# ----------------------------------------------------------------------------- one job or two


def test_dump_sets_of_different_jobs_are_refused_unless_forced(tmp_path):
    make_set(tmp_path / "a", "--ranks", "8", "--mesh", "2x4", "--entries", "30",
             "--fault", "size")
    make_set(tmp_path / "b", "--ranks", "16", "--mesh", "4x4", "--entries", "30",
             "--fault", "size", "--prefix", "nccl_trace_rank_")
    with pytest.raises(MoeHangError) as exc:
        analyze_paths([tmp_path / "a", tmp_path / "b"], force=False)
    text = _one_line(exc)
    assert str(tmp_path / "a") in text and str(tmp_path / "b") in text
    assert "world size 8 vs 16" in text and "file prefix" in text and "--force" in text
    d = analyze_paths([tmp_path / "a", tmp_path / "b"], force=True)
    assert any("analyzed together (--force)" in line for line in d.evidence)


def test_two_prefixes_in_one_directory_are_two_sets(tmp_path):
    for p in (REAL / "p2p2" / "pickle").iterdir():
        shutil.copy(p, tmp_path / p.name)
        shutil.copy(p, tmp_path / p.name.replace(PREFIX, "nccl_trace_rank_"))
    with pytest.raises(MoeHangError) as exc:
        analyze_paths([tmp_path], force=False)
    assert "file prefix" in _one_line(exc)


def test_dumps_split_over_nodes_merge_into_one_job(tmp_path):
    truth = make_set(tmp_path / "all", "--ranks", "16", "--mesh", "4x4", "--entries", "40",
                     "--fault", "op")
    for node in (0, 1):
        (tmp_path / f"node{node}").mkdir()
        for r in range(node * 8, node * 8 + 8):
            shutil.move(tmp_path / "all" / f"{PREFIX}{r}", tmp_path / f"node{node}")
    d = analyze_paths([tmp_path / "node0", tmp_path / "node1" / PREFIX], force=False)
    assert d.culprit_ranks == truth["culprits"]


def _capture(root: Path, run_id: str, world: int = 2) -> Path:
    (root / "ranks").mkdir(parents=True)
    ranks = {str(r): {"pid": 100 + r, "host": "node0", "alive": True, "exit_code": None,
                      "env": {"TORCHELASTIC_RUN_ID": run_id, "MASTER_ADDR": "10.0.0.1",
                              "MASTER_PORT": "29500"}} for r in range(world)}
    (root / "processes.json").write_text(json.dumps({"world_size": world, "job": "stalled",
                                                     "ranks": ranks}))
    return root


def test_captures_of_different_jobs_are_refused(tmp_path):
    a = _capture(tmp_path / "a", "job-a")
    b = _capture(tmp_path / "b", "job-b")
    with pytest.raises(MoeHangError) as exc:
        analyze_paths([a, b], force=False)
    assert "TORCHELASTIC_RUN_ID job-a vs job-b" in _one_line(exc)
    analyze_paths([a, b], force=True)  # told to: analyzed (inconclusive, but no error)


def _watch_capture(root: Path, rdzv_id: str, endpoint: str) -> Path:
    """As `moe-hang watch` leaves it: no environment in processes.json, the launch command
    in meta.json."""
    (root / "ranks").mkdir(parents=True)
    (root / "processes.json").write_text(json.dumps({"world_size": 4, "job": "stalled",
                                                     "ranks": {}}))
    (root / "meta.json").write_text(json.dumps({"tool": "moe-hang", "command": ["moe-hang"],
                                                "job_command": [
        "torchrun", "--nnodes", "2", "--rdzv_backend", "c10d", f"--rdzv-endpoint={endpoint}",
        "--rdzv_id", rdzv_id, "train.py"]}))
    return root


def test_watch_captures_are_told_apart_by_their_launch_command(tmp_path):
    a = _watch_capture(tmp_path / "a", "run-1", "10.0.0.1:29400")
    b = _watch_capture(tmp_path / "b", "run-1", "10.0.0.1:29400")
    c = _watch_capture(tmp_path / "c", "run-2", "10.0.0.9:29400")
    analyze_paths([a, b], force=False)  # one job: no refusal
    with pytest.raises(MoeHangError) as exc:
        analyze_paths([a, c], force=False)
    text = _one_line(exc)
    assert "TORCHELASTIC_RUN_ID run-1 vs run-2" in text
    assert "rendezvous 10.0.0.1:29400 vs 10.0.0.9:29400" in text


def test_a_capture_and_the_dumps_of_its_job_merge(tmp_path):
    cap = _capture(tmp_path / "cap", "job-a", world=4)
    d = analyze_paths([cap, REAL / "mesh4_skip" / "pickle"], force=False)
    assert d.culprit_ranks == [3]
    assert {r.rank: r.host for r in d.ranks} == {r: "node0" for r in range(4)}
    with pytest.raises(MoeHangError) as exc:  # a capture of 2 ranks is another job
        analyze_paths([_capture(tmp_path / "cap2", "job-b"), REAL / "mesh4_skip" / "pickle"],
                      force=False)
    assert "world size 2 vs 4" in _one_line(exc)


# ----------------------------------------------------------------------------- the CLI


@pytest.mark.timeout(120)
def test_cli_analyze_reads_a_dump_directory(tmp_path):
    proc = run_cli("analyze", str(REAL / "mesh4_skip" / "json"), "--json", timeout=60)
    assert_no_survivors(str(REAL / "mesh4_skip" / "json"))
    assert proc.returncode == 3, proc.stderr
    d = json.loads(proc.stdout)
    assert d["verdict"] == "desync" and d["culprit_ranks"] == [3]
    assert d["first_divergence"]["pg"] == "4" and d["first_divergence"]["seq"] == 2


@pytest.mark.timeout(180)
def test_cli_analyze_of_a_set_big_enough_for_workers(tmp_path):
    truth = make_set(tmp_path / "s", "--ranks", "64", "--mesh", "8x8", "--entries", "400",
                     "--fault", "size")
    size = postmortem.find([tmp_path / "s"]).sets[0].size
    assert size >= postmortem.POOL_MIN_BYTES
    assert load_sets._workers(64, size) == min(2, len(os.sched_getaffinity(0)))
    proc = run_cli("analyze", str(tmp_path / "s"), "--json", timeout=120)
    assert_no_survivors(str(tmp_path / "s"))
    assert proc.returncode == 3, proc.stderr
    assert json.loads(proc.stdout)["culprit_ranks"] == truth["culprits"]


@pytest.mark.timeout(120)
def test_cli_analyze_of_nothing_readable_is_one_error_line(tmp_path):
    (tmp_path / "x.txt").write_text("x")
    proc = run_cli("analyze", str(tmp_path), timeout=60)
    assert_no_survivors(str(tmp_path))
    assert proc.returncode == 1
    err = proc.stderr.strip()
    assert err.startswith("[error] nothing to analyze") and "\n" not in err, err
    assert "Traceback" not in proc.stderr
