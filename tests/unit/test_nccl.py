"""The verdicts NCCL's own evidence gives (moe_hang.analysis.ras, the RAS rows of
analysis/rules.py): on the layouts of real RAS captures (tests/unit/fixtures/ras: Ray's 2.28.9
4-node mismatch and its callback test's reports incl. the missing comma, SGLang's 2.30.7 ones,
NCCL's ras.rst samples) and on recorder dumps with and without TORCH_NCCL_ENABLE_TIMING=1
(tests/unit/fixtures/fr_started). Every asymmetric case is also run mirrored: the culprit
moves with the rank that is behind, dead or in error."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import sys
from pathlib import Path

import pytest
from conftest import FIXTURES, make_fr_set

from moe_hang.analysis.diagnosis import Diagnosis
from moe_hang.analysis.ras.counts import LAUNCH_COUNTS_CAVEAT
from moe_hang.analysis.rules import RULES, diagnose
from moe_hang.commands.diagnose import analyze_paths
from moe_hang.evidence.flight_recorder import FRDump, PgStatus
from moe_hang.evidence.model import Evidence, RankEvidence
from moe_hang.evidence.ras import RasPoll, parse_report
from moe_hang.evidence.ras_files import attach_ras, read_ras_files

RAS = FIXTURES / "ras"
STARTED = FIXTURES / "fr_started"
SEQ = json.loads((STARTED / "json" / "truth.json").read_text())["seq"]


def _writer():
    spec = importlib.util.spec_from_file_location("ras_write_fixtures",
                                                  RAS / "write_fixtures.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("ras_write_fixtures", mod)
    spec.loader.exec_module(mod)
    return mod


W = _writer()


def ras_only(*names: str) -> Diagnosis:
    ev = Evidence(ranks={})
    attach_ras(ev, read_ras_files([RAS / n for n in names]))
    return diagnose(ev)


def with_reports(ev: Evidence, *texts: str) -> Diagnosis:
    attach_ras(ev, [RasPoll(parse_report(t), f"poll{i}") for i, t in enumerate(texts, 1)])
    return diagnose(ev)


def no_code_bug(d: Diagnosis) -> None:
    for text in (d.summary, d.fix):
        assert not re.search(r"\b(code|bug)\b", text, re.I), text


# ----------------------------------------------------------------------------- the rows


NEW_ROWS = ["NCCL rank gone (RAS)", "NCCL error on a rank (RAS)",
            "frozen launch counts disagree (RAS)", "NCCL launch counts moving (RAS)",
            "transport or hardware hang", "launch counts differ in one RAS report",
            "one RAS report, nothing wrong in it"]


def test_the_new_rows_sit_where_they_belong():
    names = [r.name for r in RULES]
    assert len(names) == len(set(names))
    at = {n: names.index(n) for n in NEW_ROWS}
    # a rank dead or in error: after what the ranks' own exits say, before any desync
    assert names.index("rank left early") < at["NCCL rank gone (RAS)"] \
        < at["NCCL error on a rank (RAS)"] < names.index("wait-for cycle")
    # frozen counts: after the recorder's and the stacks' own desync rows
    assert names.index("unmatched send/recv") < at["frozen launch counts disagree (RAS)"] \
        < names.index("launcher died")
    assert names.index("every rank moving") < at["NCCL launch counts moving (RAS)"]
    assert names.index("straggler") < at["transport or hardware hang"] \
        < at["launch counts differ in one RAS report"] \
        < names.index("all wait in matching collectives")
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    for n in NEW_ROWS:
        assert f"| {n} |" in readme, n


# ----------------------------------------------------------------------------- RAS alone


def test_rays_four_node_capture_one_poll_names_the_rank_behind_uncertainly():
    d = ras_only("mismatch_4node_2.28.9.json")
    assert d.verdict == "hang" and d.certainty == "uncertain"
    assert d.rule == "launch counts differ in one RAS report" and d.culprit_ranks == [1]
    assert d.culprit_basis == "launch_counts" and LAUNCH_COUNTS_CAVEAT in d.summary
    assert "second report" in d.fix


@pytest.mark.parametrize("behind", [1, 3, 0])
def test_rays_capture_frozen_over_two_polls_is_a_desync_of_the_rank_behind(behind):
    if behind == 1:
        d = ras_only("mismatch_4node_2.28.9.json", "mismatch_4node_2.28.9_poll2.json")
    else:  # mirrored: another rank is the one behind
        polls = [f"mismatch_4node_2.28.9{x}.json" for x in ("", "_poll2")]
        texts = [(RAS / p).read_text().replace('"AllReduce": 100', '"AllReduce": 101')
                 for p in polls]
        texts = [_lag(t, behind) for t in texts]
        d = with_reports(Evidence(ranks={}), *texts)
    assert d.verdict == "desync" and d.certainty == "likely"
    assert d.rule == "frozen launch counts disagree (RAS)" and d.culprit_ranks == [behind]
    assert f"Rank {behind} never launched the 101st AllReduce" in d.summary
    assert LAUNCH_COUNTS_CAVEAT in d.summary and d.nccl_ras is not None
    assert d.nccl_ras["compared"] and d.nccl_ras["interval_s"] == 5.0


def _lag(text: str, rank: int) -> str:
    """The Ray layout with communicator rank ``rank`` at AllReduce 100."""
    data = json.loads(text)
    for r in data["communicators"][0]["ranks"]:
        r["collective_counts"]["AllReduce"] = 100 if r["rank"] == rank else 101
    return json.dumps(data, indent=2)


def test_a_frozen_mismatch_in_an_expert_group_blames_its_global_rank():
    d = ras_only("frozen_mismatch_poll1.json", "frozen_mismatch_poll2.json")
    assert d.verdict == "desync" and d.culprit_ranks == [3]
    assert "151st AllGather" in d.summary and "rank 1 launched" in d.summary


def test_the_missing_comma_report_is_a_rank_ras_cannot_reach():
    d = ras_only("missing_comma_2.28.9.json")
    assert d.verdict == "rank_died" and d.certainty == "likely" and d.culprit_ranks == [1]
    assert "process 5301 on 10.1.20.33" in d.summary
    assert any("repaired" in e or "comma" in e for e in d.evidence)


@pytest.mark.parametrize("missing", [1, 0])
def test_sglangs_unresponsive_rank_is_a_dead_rank(missing):
    if missing == 1:
        d = ras_only("unresponsive_2.30.7.json")
    else:  # mirrored
        c = W.Comm(0x0badcafe0badcafe, (0x1357135713571357, 0x2468246824682468), 2,
                   [W.Rank(1, "172.18.0.4", 4821, 1, W.ar(20))],
                   [W.Missing(0, "172.18.0.4", 4820, 0)])
        d = with_reports(Evidence(ranks={}), json.dumps(json.loads(
            W.write("2.30.7", 13030, 13020, "2026-03-05 10:17:21", [c])), indent=2))
    assert d.verdict == "rank_died" and d.culprit_ranks == [missing]
    assert d.rule == "NCCL rank gone (RAS)" and d.culprit_basis == "exited"


def test_a_rank_considered_dead_is_definite():
    d = ras_only("dead_rank_2.29.7.json")
    assert d.verdict == "rank_died" and d.certainty == "definite" and d.culprit_ranks == [2]
    assert "process 8802 on 192.168.50.12" in d.summary and "dmesg" in d.fix


@pytest.mark.parametrize("err,abort", [(2, 3), (0, 1)])
def test_an_async_error_is_the_root_cause_on_that_rank(err, abort):
    ranks = [W.Rank(i, "192.168.50.11" if i < 2 else "192.168.50.12", 9100 + i, i % 2,
                    W.ar(88)) for i in range(4)]
    ranks[err].async_error = 6
    ranks[abort].abort = ranks[abort].destroy = True
    text = W.write("2.29.7", 12090, 12090, "2026-03-03 18:22:45", [
        W.Comm(0x7766554433221100, (0x1234123412341234, 0x5678567856785678), 4, ranks)],
        collection=0.004)
    if (err, abort) == (2, 3):
        assert text == (RAS / "async_error_2.29.7.json").read_text()
    d = with_reports(Evidence(ranks={}), text)
    assert d.verdict == "crash" and d.culprit_ranks == [err] and d.culprit_basis == "nccl_error"
    assert d.certainty == "likely"  # ncclRemoteError: it may have started at a peer
    assert "ncclRemoteError" in d.summary and f"rank {abort}'s communicator" in d.summary
    assert "NCCL_DEBUG=INFO" in d.fix


def test_an_abort_on_every_rank_blames_nobody():
    ranks = [W.Rank(i, "10.0.0.1", 100 + i, i, W.ar(5), abort=True) for i in range(2)]
    d = with_reports(Evidence(ranks={}), W.write("2.29.7", 1, 1, "2026-03-03 18:22:45", [
        W.Comm(0xabc, (1, 2), 2, ranks)]))
    assert d.rule != "NCCL error on a rank (RAS)" and d.culprit_ranks == []


def test_the_symmetric_hang_from_ras_alone_is_an_uncertain_transport_hang():
    d = ras_only("symmetric_hang_poll1.json", "symmetric_hang_poll2.json")
    assert d.verdict == "transport_hang" and d.certainty == "uncertain"
    assert d.culprit_ranks == [] and LAUNCH_COUNTS_CAVEAT in d.summary
    assert "TORCH_NCCL_ENABLE_TIMING=1" in d.summary and "outside NCCL" in d.summary
    assert "nvidia-smi" in d.fix and "10.7.0.21" in d.fix and "NCCL_DEBUG=INFO" in d.fix
    no_code_bug(d)


def test_moving_counts_are_not_a_hang():
    d = ras_only("moving_poll1.json", "moving_poll2.json")
    assert d.verdict == "healthy" and d.certainty == "likely" and d.culprit_ranks == []
    assert LAUNCH_COUNTS_CAVEAT in d.summary


def test_one_healthy_report_cannot_say_healthy():
    for name in ("healthy_2.30.7.json", "healthy_2rank_2.28.9.json", "text_ok_2.26.2.txt"):
        d = ras_only(name)
        assert d.verdict == "inconclusive", name
        assert d.rule == "one RAS report, nothing wrong in it"


def test_nccls_ras_rst_samples():
    d = ras_only("text_mismatch_2.26.2_poll1.txt", "text_mismatch_2.26.2_poll2.txt")
    assert d.verdict == "desync" and d.rule == "frozen launch counts disagree (RAS)"
    assert "communicator ranks 0, 2-5, 7" in d.summary.lower() and "6650th" in d.summary
    assert d.culprit_ranks == []  # the text report names no process per rank: not mapped
    d = ras_only("text_dead_2.26.2.txt")
    assert d.verdict == "rank_died" and d.certainty == "definite"
    assert "process 2207731 on 10.20.1.13" in d.summary
    d = ras_only("text_incomplete_2.24.3.txt")
    assert d.verdict == "rank_died" and "rank 21" in d.summary
    d = ras_only("text_status_2.24.3.txt")
    assert d.verdict == "rank_died" and "ncclCommFinalize" in d.summary


def test_every_sentence_from_counts_carries_the_caveat():
    for names in (("mismatch_4node_2.28.9.json",),
                  ("mismatch_4node_2.28.9.json", "mismatch_4node_2.28.9_poll2.json"),
                  ("frozen_mismatch_poll1.json", "frozen_mismatch_poll2.json"),
                  ("moving_poll1.json", "moving_poll2.json"),
                  ("symmetric_hang_poll1.json", "symmetric_hang_poll2.json")):
        d = ras_only(*names)
        assert LAUNCH_COUNTS_CAVEAT in d.summary, names
        for f in d.nccl_ras["findings"] if d.nccl_ras else []:
            if f["kind"] in ("moving", "lagging", "frozen_mismatch", "frozen_equal",
                             "counts_differ"):
                assert LAUNCH_COUNTS_CAVEAT in f["sentence"]


# ----------------------------------------------------------------------------- with ranks


def _ep_job(*, behind: int, recorder_behind: int) -> Evidence:
    """Four ranks on two hosts (pids as in frozen_mismatch_*.json); groups 0 (world) and 5
    (global ranks 1 and 3); each rank's recorder has no entry left but its pg_status, where
    ``recorder_behind`` posted one collective of group 5 fewer; every rank idle (in a CUDA
    sync, say), nothing moving."""
    ranks = {}
    for r in range(4):
        st = {"0": PgStatus(300, 299)}
        if r in (1, 3):
            st["5"] = PgStatus(150 if r == recorder_behind else 151, 150)
        fr = FRDump([], st, {"0": (0, 1, 2, 3), "5": (1, 3)}, backend="nccl")
        ranks[r] = RankEvidence(rank=r, pid=23300 + r, host="node-a" if r < 2 else "node-b",
                                alive=True, progressed=False, fr=fr)
    del behind
    return Evidence(ranks=ranks, world_size=4)


def _ep_reports(behind_global: int) -> list[str]:
    out = []
    for ts in ("2026-03-04 03:00:00", "2026-03-04 03:00:05"):
        data = json.loads(W.fixtures()[f"frozen_mismatch_poll{1 if '00:00' in ts else 2}.json"])
        ep = data["communicators"][1]["ranks"]
        for r in ep:
            g = 1 if r["rank"] == 0 else 3
            r["collective_counts"]["AllGather"] = 150 if g == behind_global else 151
        out.append(json.dumps(data, indent=2))
    return out


@pytest.mark.parametrize("behind", [3, 1])
def test_frozen_counts_agree_with_the_recorder_and_name_the_global_rank(behind):
    d = with_reports(_ep_job(behind=behind, recorder_behind=behind), *_ep_reports(behind))
    assert d.verdict == "desync" and d.certainty == "likely" and d.culprit_ranks == [behind]
    assert "the recorder agrees" in d.summary.lower()
    assert d.first_divergence is not None and d.first_divergence.pg == "5"
    assert d.first_divergence.seq == 151
    assert any("by host and pid" in e for e in d.evidence)


def test_frozen_counts_the_recorder_contradicts_are_said_and_uncertain():
    d = with_reports(_ep_job(behind=3, recorder_behind=1), *_ep_reports(3))
    assert d.verdict == "desync" and d.certainty == "uncertain" and d.culprit_ranks == [3]
    assert "the evidence disagrees" in d.summary


def test_a_rank_behind_whose_stack_moves_is_not_called_stuck():
    ev = _ep_job(behind=3, recorder_behind=3)
    ev.ranks[3].progressed = True
    d = with_reports(ev, *_ep_reports(3))
    assert d.certainty != "likely" or d.verdict != "desync"


# ----------------------------------------------------------------------------- the recorder


def _sym_reports(ranks: int = 4) -> list[str]:
    """A 4-rank world frozen at equal counts over two polls (RAS hosts and pids made up)."""
    out = []
    for ts in ("2026-03-04 02:10:00", "2026-03-04 02:10:05"):
        out.append(W.write("2.29.7", 12090, 12090, ts, [W.Comm(
            0x8e8e8e8e12345678, (0xabc, 0xdef), ranks,
            [W.Rank(i, "10.7.0.21", 41000 + i, i, {"AllReduce": 5120}) for i in range(ranks)])]))
    return out


def _dumps(form: str) -> Evidence:
    from moe_hang.evidence.flight_recorder.postmortem import evidence, find, load_sets

    found = find([STARTED / form])
    return evidence(load_sets(found.sets))


def test_started_everywhere_and_ras_frozen_is_a_likely_transport_hang():
    d = with_reports(_dumps("json"), *_sym_reports())
    assert d.verdict == "transport_hang" and d.certainty == "likely"
    assert d.rule == "transport or hardware hang" and d.culprit_ranks == []
    assert "every rank's kernel started it" in d.summary and LAUNCH_COUNTS_CAVEAT in d.summary
    assert "nvidia-smi" in d.fix and "NCCL_DEBUG=INFO" in d.fix and "replace the node" in d.fix
    no_code_bug(d)


def test_without_timing_ras_frozen_is_uncertain_and_says_timing_would_tell():
    d = with_reports(_dumps("no_timing"), *_sym_reports())
    assert d.verdict == "transport_hang" and d.certainty == "uncertain"
    assert "TORCH_NCCL_ENABLE_TIMING=1 would tell" in d.summary
    no_code_bug(d)


def _edited(tmp_path: Path, edit) -> Path:
    out = tmp_path / "set"
    shutil.copytree(STARTED / "json", out)
    for r in range(4):
        p = out / f"comm_lib_trace_rank_{r}.json"
        d = json.loads(p.read_text())
        for e in d["entries"]:
            if e["process_group"][0] == "0" and e["collective_seq_id"] == SEQ:
                edit(r, e)
        p.write_text(json.dumps(d, sort_keys=True, separators=(",", ":")))
    return out


@pytest.mark.parametrize("late", [2, 0])
def test_a_kernel_that_started_seconds_after_the_others_is_named(tmp_path, late):
    def edit(r, e):
        if r == late:
            e["time_discovered_started_ns"] += 3_000_000_000

    d = analyze_paths([_edited(tmp_path, edit)], force=False)
    assert d.verdict == "transport_hang" and d.culprit_ranks == [late]
    assert d.culprit_basis == "kernel_timing" and "3.0 s after" in d.summary


@pytest.mark.parametrize("never", [1, 3])
def test_a_kernel_that_never_started_names_that_gpu(tmp_path, never):
    def edit(r, e):
        if r == never:
            e["state"], e["time_discovered_started_ns"] = "scheduled", 0

    d = analyze_paths([_edited(tmp_path, edit)], force=False)
    assert d.verdict == "transport_hang" and d.culprit_ranks == [never]
    assert f"rank {never}'s never did" in d.summary


def test_the_readmes_example_and_reports_of_another_job(tmp_path):
    ras = [RAS / f"symmetric_hang_1node_poll{i}.json" for i in (1, 2)]
    d = analyze_paths([STARTED / "json"], force=False, ras=read_ras_files(ras))
    assert d.verdict == "transport_hang" and d.certainty == "likely"
    assert d.nccl_ras is not None and d.nccl_ras["mapped_by"] == "the numbering of the " \
        "communicator that holds every process"
    from moe_hang.errors import MoeHangError

    eight = read_ras_files([RAS / f"symmetric_hang_poll{i}.json" for i in (1, 2)])
    with pytest.raises(MoeHangError, match="8 ranks, but the job has 4"):
        analyze_paths([STARTED / "json"], force=False, ras=eight)
    assert analyze_paths([STARTED / "json"], force=True, ras=eight).verdict == "transport_hang"


def test_the_generators_stall_is_a_transport_hang_on_nccl_only(tmp_path):
    make_fr_set(tmp_path / "n", "--ranks", "8", "--mesh", "2x4", "--entries", "40",
                "--fault", "stall", "--timing", "--frames")
    d = analyze_paths([tmp_path / "n"], force=False)
    assert d.verdict == "transport_hang" and d.culprit_ranks == []
    make_fr_set(tmp_path / "g", "--ranks", "4", "--mesh", "2x2", "--entries", "16",
                "--fault", "stall", "--backend", "gloo")
    d = analyze_paths([tmp_path / "g"], force=False)
    assert d.verdict == "hang" and d.rule == "all wait in matching collectives"


def test_counts_moving_while_the_ranks_look_stuck_is_only_uncertainly_healthy():
    """watch must never end a job NCCL says is launching: uncertain, so it watches on."""
    ev = _ep_job(behind=3, recorder_behind=3)
    d = with_reports(ev, *[(RAS / f"moving_poll{i}.json").read_text() for i in (1, 2)])
    assert d.verdict == "healthy" and d.certainty == "uncertain"
    assert "showed no progress" in d.summary


def test_a_transport_hang_held_past_hang_after_stays_a_transport_hang():
    ev = _dumps("no_timing")
    ev.held = "no progress on any rank for 300 s (--hang-after)"
    d = diagnose(ev)
    assert d.rule == "stall held past --hang-after" and d.verdict == "transport_hang"
    assert d.summary.startswith("No progress on any rank for 300 s")


def _two_comms(world_behind: tuple[int, ...], ep_behind: int) -> list[str]:
    """The expert-parallel layout (world of 4, EP of global ranks 1 and 3), frozen: in the
    world ``world_behind`` are one AllReduce behind, in EP ``ep_behind`` one AllGather."""
    out = []
    for i in (1, 2):
        data = json.loads(W.fixtures()[f"frozen_mismatch_poll{i}.json"])
        world, ep = data["communicators"]
        for r in world["ranks"]:
            r["collective_counts"]["AllReduce"] = 299 if r["rank"] in world_behind else 300
        for r in ep["ranks"]:
            g = 1 if r["rank"] == 0 else 3
            r["collective_counts"]["AllGather"] = 150 if g == ep_behind else 151
        out.append(json.dumps(data, indent=2))
    return out


@pytest.mark.parametrize("ep_behind,other", [(3, 1), (1, 3)])
def test_a_rank_held_in_another_communicator_is_not_the_culprit(ep_behind, other):
    """``other`` is behind in the world, but ahead in EP: it launched EP's all-gather and
    waits there for ``ep_behind``, who launched nothing anywhere — the culprit, mirrored."""
    d = with_reports(Evidence(ranks={}), *_two_comms((1, 3), ep_behind))
    assert d.verdict == "desync" and d.certainty == "likely"
    assert d.culprit_ranks == [ep_behind], d.summary
    assert "151st AllGather" in d.summary and "held up behind it" in d.summary


@pytest.mark.parametrize("stuck", [0, 2])
def test_the_chain_ends_where_the_ranks_behind_wait_on_nobody(stuck):
    """Rank 3 is behind in EP but ahead in the world, waiting there for ``stuck``."""
    d = with_reports(Evidence(ranks={}), *_two_comms((stuck,), 3))
    assert d.culprit_ranks == [stuck] and "AllReduce" in d.summary


def test_two_communicators_waiting_on_each_other_name_both_uncertainly():
    """Rank 1 behind in the world and ahead in EP, rank 3 the other way round: a cycle the
    counts cannot break (which skipped first, only the stacks say)."""
    d = with_reports(Evidence(ranks={}), *_two_comms((1,), 3))
    assert d.verdict == "desync" and d.certainty == "uncertain" and d.culprit_ranks == [1, 3]
    assert "do not say who began it" in d.summary


@pytest.mark.parametrize("never", [None, 2])
def test_from_the_probes_heartbeats_as_watch_sees_them(never):
    """watch's view: no dump, each rank's heartbeat with its pending entry and pg_status."""
    from moe_hang.evidence.probe_records import Heartbeat

    ranks = {}
    for r in range(4):
        started = r != never
        entry = {"pg_id": 0, "process_group": ["0", "default_pg"], "collective_seq_id": 41,
                 "profiling_name": "nccl:all_reduce", "input_sizes": [[1]],
                 "output_sizes": [[1]], "input_dtypes": ["Float"],
                 "time_created_ns": 1_000_000_000 + r,
                 "state": "started" if started else "scheduled",
                 "time_discovered_started_ns": 1_000_500_000 + r if started else None,
                 "time_discovered_completed_ns": None}
        hb = Heartbeat.parse({"rank": r, "pid": 100 + r, "host": "node0", "pending": [entry],
                              "pg_status": {"0": {"enqueued": 41, "completed": 40,
                                                  "started": 41 if started else 40}}})
        ranks[r] = RankEvidence(rank=r, pid=100 + r, host="node0", alive=True,
                                progressed=False, heartbeat=hb)
    d = diagnose(Evidence(ranks=ranks, world_size=4))
    assert d.verdict == "transport_hang" and d.certainty == "uncertain"  # no RAS
    assert d.culprit_ranks == ([] if never is None else [never])
    assert "TORCH_NCCL_ENABLE_TIMING=1 would tell" not in d.summary
    if never is not None:
        assert "node0" in d.fix and d.culprit_basis == "kernel_timing"
