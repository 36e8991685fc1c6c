"""NCCL RAS reports (moe_hang.evidence.ras): both formats, the 2.28.7/2.28.9 comma repair,
global ranks by (host, pid), and what two polls a few seconds apart show — pure, on the
fixtures of tests/unit/fixtures/ras (README.md there: which real capture each follows)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import FIXTURES

from moe_hang.analysis.ras.compare import compare_reports
from moe_hang.analysis.ras.counts import LAUNCH_COUNTS_CAVEAT, launched, ordinal, with_launch_caveat
from moe_hang.analysis.ras.findings import COUNT_KINDS, FindingKind
from moe_hang.evidence.ras import (
    RankState,
    RasCommunicator,
    RasRankFlags,
    RasReport,
    RasReportError,
    comm_global_ranks,
    load_report,
    parse_report,
)
from moe_hang.evidence.ras.jsonreport import REPAIRED_COMMA, canonical_hash

RAS = FIXTURES / "ras"
REPORTS = sorted(p for p in RAS.iterdir() if p.suffix in (".json", ".txt"))


def rep(name: str) -> RasReport:
    return load_report(RAS / name)


def comm(report: RasReport, i: int = 0) -> RasCommunicator:
    return report.communicators[i]


def counts_of(c: RasCommunicator, op: str = "AllReduce") -> dict[int, int]:
    return {r.rank: r.collective_counts[op] for r in c.ranks}


# ----------------------------------------------------------------------------- reading


def test_every_fixture_is_listed_in_the_readme_and_parses():
    readme = (RAS / "README.md").read_text()
    assert len(REPORTS) >= 20
    for p in REPORTS:
        assert f"`{p.name}`" in readme, p.name
        r = load_report(p)
        assert r.fmt == ("json" if p.suffix == ".json" else "text")
        assert r.nccl_version.startswith("2.")


def test_json_report_of_four_nodes_with_one_rank_behind():
    r = rep("mismatch_4node_2.28.9.json")
    assert (r.nccl_version, r.cuda_runtime_version, r.cuda_driver_version) == \
        ("2.28.9", 12090, 13000)
    assert r.timestamp == "2026-03-02 14:20:11" and r.collection_time_s == 0.002
    assert r.timeouts == 0 and r.repaired == ""
    c = comm(r)
    assert c.hash == "0x9b0c33e1d4a5f607" and c.size == 4 and c.complete
    assert c.secondary_hash == "0x5e61a0b2c3d4e5f6:0x1a2b3c4d5e6f708"
    assert counts_of(c) == {0: 101, 1: 100, 2: 101, 3: 101}
    assert {r.host for r in c.ranks} == {"10.42.3.17", "10.42.7.91", "10.42.12.5",
                                         "10.42.9.240"}
    assert [x.pid for x in c.ranks] == [7311, 7288, 7302, 7295]
    assert all(x.state is RankState.RUNNING for x in c.ranks)
    assert c.missing_ranks == ()


def test_python_reserialised_json_reads_the_same():
    """SGLang stores its 2.30.7 captures re-serialised (``[]``, ``0.0``, no final newline)."""
    r = rep("unresponsive_2.30.7.json")
    c = comm(r)
    assert r.collection_time_s == 0.0 and len(c.ranks) == 1
    m = c.missing_ranks[0]
    assert (m.rank, m.host, m.pid, m.unresponsive, m.considered_dead) == \
        (1, "172.18.0.4", 4821, True, False)


def test_the_missing_comma_of_nccl_2_28_is_repaired_and_said():
    text = (RAS / "missing_comma_2.28.9.json").read_text()
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)
    r = parse_report(text)
    assert r.repaired == REPAIRED_COMMA and "2.28.7" in r.repaired
    m = comm(r).missing_ranks[0]
    assert (m.rank, m.pid, m.nvml_dev, m.unresponsive, m.considered_dead) == \
        (1, 5301, 1, True, False)
    assert counts_of(comm(r)) == {0: 4}


def test_a_different_syntax_error_is_refused_with_its_place():
    good = (RAS / "healthy_2rank_2.28.9.json").read_text()
    # a live rank's missing comma: not the known defect, so not repaired
    broken = good.replace('"nvml_dev": 0,', '"nvml_dev": 0', 1)
    with pytest.raises(RasReportError, match=r"not valid JSON: Expecting ',' delimiter at line"):
        parse_report(broken)
    with pytest.raises(RasReportError, match="not valid JSON"):
        parse_report(good[: len(good) // 2])  # truncated


def test_the_repair_does_not_hide_another_error():
    text = (RAS / "missing_comma_2.28.9.json").read_text()
    broken = text.replace('"size": 2,', '"size": 2', 1)
    with pytest.raises(RasReportError, match="even with the missing comma"):
        parse_report(broken)


@pytest.mark.parametrize("text,why", [
    ("", "empty"),
    ('{"nccl_version": "2.29.7"}', "no 'communicators'"),
    ('{"communicators": [{"size": 2}]}', "no 'hash'"),
    ('{"communicators": [{"hash": "0x1", "ranks": [{"rank": "0"}]}]}', "not an integer"),
    ('{"communicators": [{"hash": "zz"}]}', "not hexadecimal"),
    ("Job summary\n===========\n", "not a RAS status report"),
])
def test_what_is_not_a_report_is_refused_with_a_reason(text, why):
    with pytest.raises(RasReportError, match=why):
        parse_report(text)


def test_load_names_the_file(tmp_path):
    p = tmp_path / "ras.json"
    p.write_text("{")
    with pytest.raises(RasReportError, match=r"ras\.json: not valid JSON"):
        load_report(p)
    with pytest.raises(RasReportError, match="nope"):
        load_report(tmp_path / "nope")


def test_hashes_of_both_formats_meet():
    # JSON writes 0x%lx (no padding), text %016lx (padding, no 0x)
    assert canonical_hash("0x2fda2edc54faea7", "x") == canonical_hash("02fda2edc54faea7", "x")
    assert rep("text_mismatch_2.26.2_poll1.txt").communicators[0].hash == "0x00b1c2d3e4f50617"


@pytest.mark.parametrize("flags,state,error", [
    (RasRankFlags(0, 0, False, False, False), RankState.RUNNING, None),
    (RasRankFlags(7, 0, False, False, False), RankState.INIT, None),
    (RasRankFlags(3, 0, False, False, False), RankState.INIT, "initialization failed with "
                                                               "ncclInternalError"),
    (RasRankFlags(0, 6, False, False, False), RankState.RUNNING, "asynchronous error "
                                                                  "ncclRemoteError"),
    (RasRankFlags(0, 0, True, False, False), RankState.FINALIZE, None),
    (RasRankFlags(0, 0, False, True, True), RankState.ABORT, None),  # abort beats destroy
])
def test_rank_state_as_nccl_derives_it(flags, state, error):
    assert flags.state is state and flags.error == error


# ----------------------------------------------------------------------------- text format


def test_text_report_with_a_count_mismatch():
    r = rep("text_mismatch_2.26.2_poll1.txt")
    assert (r.fmt, r.nccl_version, r.cuda_runtime_version, r.collection_time_s) == \
        ("text", "2.26.2", 12080, 0.003)
    row = r.groups[0]
    assert (row.comms, row.nodes_per_comm, row.ranks_per_node, row.ranks_per_comm,
            row.state, row.errors) == (1, 4, "8", 32, "RUNNING", "MISMATCH")
    c = comm(r)
    assert (c.label, c.size, c.complete) == ("#0-0", 32, False)
    assert [(g.op, g.count, g.n_ranks, g.ranks) for g in c.count_groups] == [
        ("AllReduce", 6650, 26, ()), ("AllReduce", 6649, 6, (0, 2, 3, 4, 5, 7))]
    r4 = next(x for x in c.ranks if x.rank == 4)
    assert (r4.pid, r4.host, r4.cuda_dev, r4.collective_counts) == \
        (61204, "10.20.1.11", 4, {"AllReduce": 6649})


def test_text_report_of_nccl_2_24_incomplete():
    r = rep("text_incomplete_2.24.3.txt")
    assert r.timeouts == 2 and r.collection_time_s == 2.051
    assert [(p.pid, p.host, p.gpus) for p in r.missing_processes] == \
        [(2207731, "10.20.1.13", "5")]
    m = comm(r).missing_ranks
    assert [(x.rank, x.pid, x.unresponsive, x.considered_dead) for x in m] == \
        [(21, -1, True, False)]  # 2.24 names the rank only


def test_text_report_names_a_dead_process_and_its_rank():
    r = rep("text_dead_2.26.2.txt")
    assert [(p.pid, p.host) for p in r.dead_processes] == [(2207731, "10.20.1.13")]
    m = comm(r).missing_ranks[0]
    assert (m.rank, m.pid, m.host, m.cuda_dev, m.considered_dead) == \
        (21, 2207731, "10.20.1.13", 5, True)


def test_text_report_with_status_groups_of_nccl_2_24():
    r = rep("text_status_2.24.3.txt")
    assert [(g.group, g.state, g.errors) for g in r.groups] == [
        (0, "FINALIZE", "MISMATCH"), (1, "RUNNING", "OK"), (2, "INIT", "OK")]
    c = comm(r)
    assert [(g.state, g.n_ranks, g.ranks) for g in c.status_groups] == [
        (RankState.UNKNOWN, 26, ()), (RankState.RUNNING, 4, (0, 8, 16, 24)),
        (RankState.FINALIZE, 2, (4, 20))]
    assert [(g.op, g.count, g.n_ranks, g.ranks) for g in c.count_groups] == [
        ("collective", 812, 31, ()), ("collective", 811, 1, (4,))]
    r4 = next(x for x in c.ranks if x.rank == 4)
    assert r4.state is RankState.FINALIZE and r4.collective_counts == {"collective": 811}


def test_a_healthy_text_report_has_no_communicator_block():
    r = rep("text_ok_2.26.2.txt")
    assert r.communicators == () and r.groups[0].errors == "OK" and r.groups[0].comms == 8


# ----------------------------------------------------------------------------- global ranks


def test_communicator_ranks_map_to_global_ranks_by_host_and_pid():
    r = rep("frozen_mismatch_poll1.json")
    procs = {("10.9.4.2", 23300): 0, ("10.9.4.2", 23301): 1, ("10.9.4.3", 23302): 2,
             ("10.9.4.3", 23303): 3}
    world, ep = r.communicators
    assert comm_global_ranks(world, procs) == {0: 0, 1: 1, 2: 2, 3: 3}
    assert comm_global_ranks(ep, procs) == {0: 1, 1: 3}
    # the same pid on the other node is another process
    assert comm_global_ranks(ep, {("10.9.4.2", 23303): 3}) == {}
    # hosts the caller knows by name, through aliases of RAS's addresses
    named = {("node-a", 23301): 1, ("node-b", 23303): 3}
    assert comm_global_ranks(ep, named, aliases={"10.9.4.2": "node-a",
                                                 "10.9.4.3": "node-b"}) == {0: 1, 1: 3}


def test_a_rank_ras_could_not_find_is_never_mapped():
    r = rep("frozen_mismatch_poll1.json")
    ep = comm(r, 1)
    lost = replace(ep, ranks=(replace(ep.ranks[0], host="unknown", pid=-1), ep.ranks[1]))
    assert comm_global_ranks(lost, {("unknown", -1): 7, ("10.9.4.3", 23303): 3}) == {1: 3}


def test_missing_ranks_map_too():
    c = comm(rep("dead_rank_2.29.7.json"))
    assert comm_global_ranks(c, {("192.168.50.12", 8802): 6}) == {2: 6}


# ----------------------------------------------------------------------------- two polls


def test_frozen_mismatch_names_the_rank_behind_and_its_global_rank():
    procs = {("10.9.4.2", 23300): 0, ("10.9.4.2", 23301): 1, ("10.9.4.3", 23302): 2,
             ("10.9.4.3", 23303): 3}
    cmp = compare_reports(rep("frozen_mismatch_poll1.json"), rep("frozen_mismatch_poll2.json"),
                          processes=procs)
    assert cmp.interval_s == 5.0  # from the reports' timestamps
    assert cmp.all_frozen
    (f,) = cmp.of(FindingKind.FROZEN_MISMATCH)
    assert (f.comm_hash, f.ranks, f.global_ranks, f.op, f.count, f.ahead, f.ahead_ranks) == \
        ("0x6f6f6f6f0000ef01", (1,), (3,), "AllGather", 150, 151, (0,))
    assert "rank 1 (global rank 3) never launched the 151st AllGather" in f.sentence
    assert "in 5.0 s" in f.sentence
    (eq,) = cmp.of(FindingKind.FROZEN_EQUAL)
    assert eq.comm_hash == "0x4d4d4d4d0000abcd" and eq.global_ranks == (0, 1, 2, 3)


def test_frozen_mismatch_of_the_four_node_capture():
    r = rep("mismatch_4node_2.28.9.json")
    cmp = compare_reports(r, r, interval_s=5.0)
    (f,) = cmp.of(FindingKind.FROZEN_MISMATCH)
    assert f.ranks == (1,) and f.ahead_ranks == (0, 2, 3) and (f.count, f.ahead) == (100, 101)
    assert f.global_ranks == (None,)  # no processes given: nothing guessed


def test_symmetric_hang_every_rank_frozen_at_equal_counts():
    cmp = compare_reports(rep("symmetric_hang_poll1.json"), rep("symmetric_hang_poll2.json"))
    assert cmp.all_frozen and not cmp.of(FindingKind.FROZEN_MISMATCH, FindingKind.MOVING)
    eq = cmp.of(FindingKind.FROZEN_EQUAL)
    assert [(f.comm_size, f.ranks) for f in eq] == [(8, tuple(range(8))), (4, (0, 1, 2, 3)),
                                                    (4, (0, 1, 2, 3))]
    assert "every rank waits in the same collective" in eq[0].sentence
    assert not cmp.of(FindingKind.DEAD, FindingKind.RANK_ERROR, FindingKind.ABORTED)


def test_moving_counts_are_moving():
    cmp = compare_reports(rep("moving_poll1.json"), rep("moving_poll2.json"), interval_s=3.2)
    (f,) = cmp.of(FindingKind.MOVING)
    assert f.ranks == (0, 1) and "AllReduce +56" in f.sentence and "in 3.2 s" in f.sentence
    assert not cmp.all_frozen and [c.progress for c in cmp.comms] == ["moving"]
    assert not cmp.of(FindingKind.FROZEN_EQUAL, FindingKind.FROZEN_MISMATCH,
                      FindingKind.LAGGING)


def _with_counts(r: RasReport, per_rank: dict[int, int]) -> RasReport:
    c = comm(r)
    ranks = tuple(replace(x, collective_counts={**x.collective_counts, "AllReduce": v})
                  for x, v in zip(c.ranks, per_rank.values(), strict=True))
    return replace(r, communicators=(replace(c, ranks=ranks),))


def test_a_rank_that_stays_behind_while_the_other_launches_is_lagging():
    first = rep("moving_poll1.json")  # 400, 399
    second = _with_counts(rep("moving_poll2.json"), {0: 455, 1: 399})
    cmp = compare_reports(first, second, interval_s=3.0)
    (mv,) = cmp.of(FindingKind.MOVING)
    (lag,) = cmp.of(FindingKind.LAGGING)
    assert mv.ranks == (0,) and (lag.ranks, lag.count, lag.ahead) == ((1,), 399, 455)


def test_a_communicator_that_never_launched_anything():
    r = _with_counts(rep("moving_poll1.json"), {0: 0, 1: 0})
    (f,) = compare_reports(r, r).of(FindingKind.FROZEN_EQUAL)
    assert "launched no collective yet" in f.sentence


def test_counts_that_go_down_are_not_compared():
    first = rep("moving_poll2.json")  # 455, 455
    second = _with_counts(rep("moving_poll1.json"), {0: 0, 1: 0})  # an all-zero sample
    cmp = compare_reports(first, second)
    (f,) = cmp.of(FindingKind.COUNT_RESET)
    assert f.ranks == (0, 1) and [c.progress for c in cmp.comms] == ["unknown"]
    assert not cmp.of(FindingKind.FROZEN_EQUAL, FindingKind.MOVING)


def test_dead_and_unresponsive_ranks():
    r = rep("dead_rank_2.29.7.json")
    cmp = compare_reports(r, r, interval_s=5.0)
    (d,) = cmp.of(FindingKind.DEAD)
    assert d.ranks == (2,) and "process 8802 on 192.168.50.12" in d.sentence
    assert not cmp.of(FindingKind.UNRESPONSIVE)
    (eq,) = cmp.of(FindingKind.FROZEN_EQUAL)
    assert eq.ranks == (0, 1, 3) and "3 of 4 ranks" in eq.sentence
    u = rep("missing_comma_2.28.9.json")
    (un,) = compare_reports(u, u).of(FindingKind.UNRESPONSIVE)
    assert un.ranks == (1,) and "5301" in un.detail


def test_async_error_and_abort_flag():
    r = rep("async_error_2.29.7.json")
    cmp = compare_reports(r, r)
    (err,) = cmp.of(FindingKind.RANK_ERROR)
    assert err.ranks == (2,) and "ncclRemoteError" in err.sentence
    (ab,) = cmp.of(FindingKind.ABORTED)
    assert ab.ranks == (3,)
    assert not cmp.of(FindingKind.FINALIZING)  # rank 3 also has destroy_flag: abort wins


def test_text_reports_frozen_mismatch_names_what_the_text_names():
    cmp = compare_reports(rep("text_mismatch_2.26.2_poll1.txt"),
                          rep("text_mismatch_2.26.2_poll2.txt"), interval_s=5.0)
    (f,) = cmp.of(FindingKind.FROZEN_MISMATCH)
    assert (f.ranks, f.n_ranks, f.count, f.ahead) == ((0, 2, 3, 4, 5, 7), 6, 6649, 6650)
    assert "never launched the 6650th AllReduce the other 26 launched" in f.sentence


def test_text_reports_whose_counts_changed_are_moving():
    a = rep("text_mismatch_2.26.2_poll1.txt")
    text = (RAS / "text_mismatch_2.26.2_poll2.txt").read_text().replace("6650", "6652")
    cmp = compare_reports(a, parse_report(text))
    assert [f.kind for f in cmp.findings] == [FindingKind.MOVING]


def test_text_status_report_findings():
    r = rep("text_status_2.24.3.txt")
    cmp = compare_reports(r, r)
    (fin,) = cmp.of(FindingKind.FINALIZING)
    assert fin.ranks == (4, 20)
    (nm,) = cmp.of(FindingKind.NOT_MEMBER)
    assert nm.ranks == () and nm.n_ranks == 26 and nm.sentence.startswith("26 ranks")
    (f,) = cmp.of(FindingKind.FROZEN_MISMATCH)
    assert f.op == "collective" and f.ranks == (4,)


def test_a_communicator_in_one_report_only():
    cmp = compare_reports(rep("unresponsive_2.30.7.json"), rep("healthy_2.30.7.json"))
    assert [f.kind for f in cmp.findings] == [FindingKind.APPEARED, FindingKind.VANISHED]
    assert [c.progress for c in cmp.comms] == ["unknown"]


@pytest.mark.parametrize("pair", [
    ("frozen_mismatch_poll1.json", "frozen_mismatch_poll2.json"),
    ("symmetric_hang_poll1.json", "symmetric_hang_poll2.json"),
    ("moving_poll1.json", "moving_poll2.json"),
    ("text_mismatch_2.26.2_poll1.txt", "text_mismatch_2.26.2_poll2.txt"),
    ("async_error_2.29.7.json", "async_error_2.29.7.json"),
    ("dead_rank_2.29.7.json", "dead_rank_2.29.7.json"),
])
def test_every_sentence_from_counts_says_they_are_launches(pair):
    cmp = compare_reports(rep(pair[0]), rep(pair[1]))
    assert cmp.findings
    for f in cmp.findings:
        if f.kind in COUNT_KINDS:
            assert f.sentence.endswith(f"({LAUNCH_COUNTS_CAVEAT}).")
            assert "completed" not in f.sentence
        else:
            assert LAUNCH_COUNTS_CAVEAT not in f.sentence


def test_the_launch_wording():
    assert with_launch_caveat("X.") == f"X ({LAUNCH_COUNTS_CAVEAT})."
    assert "no send/recv" in LAUNCH_COUNTS_CAVEAT and "not completions" in LAUNCH_COUNTS_CAVEAT
    assert [ordinal(n) for n in (1, 2, 3, 4, 11, 12, 13, 21, 101, 111, 112)] == \
        ["1st", "2nd", "3rd", "4th", "11th", "12th", "13th", "21st", "101st", "111th", "112th"]
    assert launched("AllReduce", 0) == "launched no AllReduce"
    assert launched("AllReduce", 1) == "launched AllReduce once"


def test_the_package_is_pure():
    import ast

    root = Path(__file__).resolve().parents[2] / "moe_hang" / "evidence" / "ras"
    for p in root.glob("*.py"):
        for node in ast.walk(ast.parse(p.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for n in names:
                top = n.split(".")[0]
                assert top not in ("torch", "rich", "subprocess", "socket", "psutil"), (p, n)
                assert not n.startswith(("moe_hang.analysis", "moe_hang.capture")), (p, n)
