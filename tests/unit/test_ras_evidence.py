"""NCCL RAS reports as a diagnosis's evidence (moe_hang.evidence.ras.evidence, .mapping,
moe_hang.evidence.ras_files): polls ordered by their timestamps, one poll vs two, global
ranks from the job's processes (or, with none known, from the communicator of every
process), and the run directory's ``ras/`` — pure, on tests/unit/fixtures/ras."""

from __future__ import annotations

import json
import shutil

import pytest
from conftest import FIXTURES

from moe_hang.analysis.ras.counts import LAUNCH_COUNTS_CAVEAT
from moe_hang.analysis.ras.findings import FindingKind
from moe_hang.analysis.ras.reading import read_ras
from moe_hang.evidence.model import Evidence, RankEvidence
from moe_hang.evidence.ras import (
    BY_PROCESS,
    BY_WORLD,
    RasPoll,
    RasReportError,
    infer_global_ranks,
    load_report,
    ras_evidence,
)
from moe_hang.evidence.ras.mapping import host_aliases
from moe_hang.evidence.ras_files import attach_run_ras, read_ras_files
from moe_hang.probe.layout import RunLayout

RAS = FIXTURES / "ras"


def polls(*names: str) -> list[RasPoll]:
    return read_ras_files([RAS / n for n in names])


def test_two_polls_are_ordered_by_their_timestamps_whatever_the_order_given():
    ev = read_ras(ras_evidence(polls("frozen_mismatch_poll2.json", "frozen_mismatch_poll1.json")))
    assert [p.source.rsplit("/", 1)[-1] for p in ev.polls] == [
        "frozen_mismatch_poll1.json", "frozen_mismatch_poll2.json"]
    assert ev.compared and ev.interval_s == 5.0
    assert ev.comparison.of(FindingKind.FROZEN_MISMATCH)


def test_one_poll_cannot_tell_frozen_but_says_where_counts_differ():
    ev = read_ras(ras_evidence(polls("mismatch_4node_2.28.9.json")))
    assert not ev.compared and ev.interval_s is None
    (f,) = ev.comparison.of(FindingKind.COUNTS_DIFFER)
    assert f.ranks == (1,) and f.count == 100 and f.ahead == 101 and f.ahead_ranks == (0, 2, 3)
    assert LAUNCH_COUNTS_CAVEAT in f.sentence and "second report" in f.sentence
    assert not ev.comparison.of(FindingKind.FROZEN_MISMATCH)
    assert any("one report" in n for n in ev.notes)


def test_the_same_second_twice_is_one_poll():
    p = polls("frozen_mismatch_poll1.json")[0]
    ev = read_ras(ras_evidence([p, RasPoll(p.report, "again")]))
    assert not ev.compared and any("cannot be told" in n for n in ev.notes)


def test_reports_of_different_jobs_are_refused():
    with pytest.raises(RasReportError, match="share no communicator"):
        polls("frozen_mismatch_poll1.json", "moving_poll2.json")
    with pytest.raises(RasReportError, match="not the same job"):
        polls("mismatch_4node_2.28.9.json", "dead_rank_2.29.7.json")


def test_a_bad_file_is_refused_with_its_name(tmp_path):
    bad = tmp_path / "ras.json"
    bad.write_text("{ not json")
    with pytest.raises(RasReportError, match=r"ras\.json"):
        read_ras_files([bad])


# ----------------------------------------------------------------------------- global ranks


def test_with_no_process_known_the_world_communicator_numbers_the_ranks():
    reports = [p.report for p in polls("frozen_mismatch_poll1.json")]
    maps, how, _ = infer_global_ranks(reports, {})
    world, ep = reports[0].communicators
    assert how == BY_WORLD
    assert maps[world.key] == {0: 0, 1: 1, 2: 2, 3: 3}
    assert maps[ep.key] == {0: 1, 1: 3}  # through the world's processes
    # a world size that does not match: no communicator is the world, nothing mapped
    maps, how, _ = infer_global_ranks(reports, {}, world_size=8)
    assert how == "" and not any(maps.values())


def test_hosts_known_by_name_are_matched_through_their_pids():
    reports = [load_report(RAS / "frozen_mismatch_poll1.json")]
    known = {("node-a", 23300): 0, ("node-a", 23301): 1, ("node-b", 23302): 2,
             ("node-b", 23303): 3}
    assert host_aliases(reports, known) == {"10.9.4.2": "node-a", "10.9.4.3": "node-b"}
    maps, how, _ = infer_global_ranks(reports, known)
    assert how == BY_PROCESS and maps[reports[0].communicators[1].key] == {0: 1, 1: 3}


def test_the_same_pids_on_two_nodes_are_not_guessed():
    reports = [load_report(RAS / "frozen_mismatch_poll1.json")]
    # containers: both nodes run pids 23300-23303; nothing says which address is which
    known = {(h, 23300 + i): 2 * (h == "node-b") + i % 2 for h in ("node-a", "node-b")
             for i in range(4)}
    assert host_aliases(reports, known) == {}
    maps, how, _ = infer_global_ranks(reports, known)
    assert how == "" and not any(maps.values())  # known processes, none matched: no guess


def test_the_mapping_moves_with_the_processes():
    """Mirror: the same report with the job's ranks numbered the other way round."""
    reports = [load_report(RAS / "frozen_mismatch_poll1.json")]
    known = {("10.9.4.2", 23300): 3, ("10.9.4.2", 23301): 2, ("10.9.4.3", 23302): 1,
             ("10.9.4.3", 23303): 0}
    maps, how, _ = infer_global_ranks(reports, known)
    assert how == BY_PROCESS and maps[reports[0].communicators[1].key] == {0: 2, 1: 0}


# ----------------------------------------------------------------------------- the run dir


def test_a_captures_polls_are_read_back_with_its_processes(tmp_path):
    layout = RunLayout(tmp_path)
    layout.ras_dir.mkdir()
    for i in (1, 2):
        shutil.copy(RAS / f"frozen_mismatch_poll{i}.json", layout.ras_poll(i, "json"))
    layout.ras_meta.write_text(json.dumps({
        "polls": [{"file": "poll1.json", "source": "RAS at localhost:28028 (socket)"},
                  {"file": "poll2.json", "source": "RAS at localhost:28028 (socket)"}],
        "interval_s": 3.02, "aliases": {"10.9.4.2": "node-a", "10.9.4.3": "node-b"}}))
    ev = Evidence(ranks={r: RankEvidence(rank=r, pid=23300 + r, host="node-a" if r < 2
                                         else "node-b") for r in range(4)}, world_size=4)
    attach_run_ras(ev, tmp_path)
    assert ev.ras is not None and ev.ras.interval_s == 3.02
    assert ev.ras.mapped_by == BY_PROCESS
    reading = read_ras(ev.ras)
    assert reading.compared and reading.interval_s == 3.02
    (f,) = reading.comparison.of(FindingKind.FROZEN_MISMATCH)
    assert f.global_ranks == (3,)


def test_a_failed_live_poll_is_a_note(tmp_path):
    layout = RunLayout(tmp_path)
    layout.ras_dir.mkdir()
    layout.ras_meta.write_text(json.dumps({"polls": [
        {"file": "poll1.json", "error": "RAS at localhost:28028: connection refused"}]}))
    ev = Evidence(ranks={})
    attach_run_ras(ev, tmp_path)
    assert ev.ras is not None and ev.ras.polls == ()
    assert read_ras(ev.ras).lines() == ["NCCL RAS: RAS at localhost:28028: connection refused"]


def test_no_ras_directory_no_ras_evidence(tmp_path):
    ev = Evidence(ranks={})
    attach_run_ras(ev, tmp_path)
    assert ev.ras is None
