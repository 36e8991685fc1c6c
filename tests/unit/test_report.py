"""The report, on diagnoses built by hand: the first screen fits 15 rows at 80 columns for every
kind of verdict, no word is ever broken, the detail and the HTML page hold the rest."""

from __future__ import annotations

import io
import os
import re
import shutil
from html.parser import HTMLParser
from pathlib import Path

import pytest
from rich.console import Console

from moe_hang.analysis.diagnosis import (
    Certainty,
    CulpritBasis,
    Diagnosis,
    Divergence,
    MismatchKind,
    RankCollective,
    RankReport,
    Timeline,
    TimelineCell,
    Verdict,
)
from moe_hang.analysis.runs import ReferenceReport, ScenarioRun, Timings, WatchRun
from moe_hang.evidence.stacks import Frame
from moe_hang.evidence.vocab import RankState, agree, spans, who
from moe_hang.report.console import render, render_text
from moe_hang.report.html import to_html
from moe_hang.report.screen import MAX_LINES, first_screen, next_verify_command
from moe_hang.report.words import ReportContext, next_words, site_groups
from moe_hang.report.wrap import screen_lines, shorten_paths, wrap

CWD = os.getcwd()
EP = f"{CWD}/moe_hang/scenarios/ep.py"
TRAIN = f"{CWD}/train.py"
SITE = "/usr/lib/python3.11/site-packages"
HINT = ("Replace DTensor.from_local(x, mesh, [Shard(0)]).full_tensor() with the varlen "
        "exchange: all-gather lengths, pad + all-gather + trim, gradient anchor, all-reduce + "
        "narrow (moe_hang.VarlenDispatch; NeMo Automodel PR #3631).")
A2A_REASON = (" With E/k = 8/2 = 4, prefer the all-to-all fix (--fix a2a, "
              "moe_hang.AllToAllDispatch): it sends each token only to the ranks of its 2 "
              "experts (about 2·k·T·D per rank per layer), where varlen gathers every token "
              "to all 4 ranks and all-reduces a full-size output (about 4·T·D·(1 + 2·3/4)); "
              "prove it with moe-hang verify --fixed --fix a2a.")


def _coll(op: str, seq: int, sizes: list[list[int]], site: Frame | None = None,
          pg: str = "0", desc: str = "default_pg") -> RankCollective:
    return RankCollective(op=op, pg=pg, seq=seq, input_sizes=sizes, pg_desc=desc,
                          callsite=site)


def _stack(*frames: str) -> list[str]:
    return ["torch/distributed/distributed_c10d.py:4394 all_gather_single", *frames]


def _timeline(world: int, seqs: list[int], hi: int, odd: int | None = None) -> Timeline:
    ranks: dict[int, list[TimelineCell | None]] = {}
    for r in range(world):
        cells: list[TimelineCell | None] = [TimelineCell("all_reduce", [[8]], "done")
                                            for _ in seqs[:-1]]
        cells.append(None if r == odd else TimelineCell("all_gather", [[4, 8]], "pending"))
        ranks[r] = cells
    return Timeline(pg="0", pg_desc="default_pg", seqs=seqs, highlight=hi, ranks=ranks)


def _scenario(variant: str = "broken", *, verified: bool | None = None,
              reproduced: bool | None = None, hint: str = HINT, nproc: int = 2,
              reference: ReferenceReport | None = None, recommended: str = "varlen"
              ) -> ScenarioRun:
    return ScenarioRun(scenario="ep-ragged", variant=variant, fix="varlen",
                       recommended_fix=recommended, fix_hint=hint, backend="gloo",
                       nproc=nproc, tokens=[68, 401][:nproc] or [68] * nproc,
                       timings=Timings(wall_s=8.0, onset_to_verdict_s=1.2),
                       reference=reference, reproduced=reproduced, verified=verified)


def ragged_repro(**run: object) -> Diagnosis:
    gather = Frame(EP, 95, "naive_gather")
    per = {0: _coll("all_gather", 1, [[68, 64]], gather),
           1: _coll("all_gather", 1, [[401, 64]], gather)}
    ranks = [RankReport(rank=r, pid=100 + r, host="node0", state=RankState.EXITED,
                        collective=per[r], callsite=gather, exit_code=[-6, -15][r],
                        phase="forward", stack=_stack(f"{EP}:95 naive_gather",
                                                      f"{CWD}/moe_hang/scenarios/worker.py:159"
                                                      " run"),
                        stack_source="py-spy",
                        tokens={"local": [68, 401][r], "per_expert": [37, 37, 29, 33]})
             for r in (0, 1)]
    return Diagnosis(
        verdict=Verdict.DESYNC,
        summary=(f"Ranks posted different sizes at seq 1 of default_pg at {EP}:95 "
                 "naive_gather: rank 0 all_gather(68×64); rank 1 all_gather(401×64); rank 0 "
                 "killed by SIGABRT, rank 1 killed by SIGTERM."),
        culprit_ranks=[0, 1], ranks=ranks, fix="varlen", artifacts="/tmp/runs/x-ep-ragged",
        first_divergence=Divergence(pg="0", seq=1, kind=MismatchKind.SIZE,
                                    pg_desc="default_pg", per_rank=dict(per), phase="forward"),
        evidence=["what():  [enforce fail at /__w/pytorch/gloo/pair.cc:456] Received data size "
                  "doesn't match expected size. Is there a distributed collective mismatch?"],
        timeline=_timeline(2, [1], 1), run=_scenario(**run))  # type: ignore[arg-type]


def skipped_collective(world: int = 2, culprit: int = 1) -> Diagnosis:
    """Every rank in all_gather at train.py:15, one in barrier at train.py:23 (watch)."""
    gather, barrier = Frame(TRAIN, 15, "dispatch"), Frame(TRAIN, 23, "<module>")
    per: dict[int, RankCollective | None] = {}
    ranks = []
    for r in range(world):
        odd = r == culprit
        c = _coll("barrier", 7, [], barrier) if odd else _coll("all_gather", 7, [[4, 8]], gather)
        per[r] = c
        ranks.append(RankReport(rank=r, pid=200 + r, state=RankState.IN_COLLECTIVE,
                                collective=c, callsite=c.callsite,
                                stack=_stack(f"{TRAIN}:{c.callsite.line} x")
                                if c.callsite else []))
    return Diagnosis(
        verdict=Verdict.DESYNC,
        summary=(f"Ranks posted different collectives at seq 7 of default_pg: rank 0 "
                 f"all_gather(4×8) at {TRAIN}:15 dispatch; rank {culprit} barrier at "
                 f"{TRAIN}:23 <module>."),
        culprit_ranks=[culprit], ranks=ranks, artifacts="/tmp/runs/w",
        fix=("Make every rank post every collective every step: do not skip a layer, expert "
             "or exchange when a rank has no tokens (run it on an empty or dummy input)."),
        first_divergence=Divergence(pg="0", seq=7, kind=MismatchKind.OP, pg_desc="default_pg",
                                    per_rank=per),
        timeline=_timeline(world, list(range(1, 8)), 7),
        run=WatchRun(command=["torchrun", "train.py"], job_exit_code=None, detected="desync"),
        culprit_basis=CulpritBasis.MAJORITY, certainty=Certainty.DEFINITE, rule="desync")


def subgroup_missing() -> Diagnosis:
    d = skipped_collective(world=4, culprit=3)
    ar = _coll("all_reduce", 4, [[16]], Frame(TRAIN, 40, "reduce_expert_grads"), pg="1",
               desc="ep_group")
    d.first_divergence = Divergence(pg="1", seq=4, kind=MismatchKind.MISSING, pg_desc="ep_group",
                                    members=[2, 3], per_rank={2: ar, 3: None})
    d.culprit_basis = CulpritBasis.PROGRAM_ORDER
    d.certainty = Certainty.LIKELY
    return d


def crash_with_code() -> Diagnosis:
    site = Frame(f"{SITE}/mylib/deeply/nested/package/module_with_a_long_name.py", 1234,
                 "a_function_with_a_rather_long_name")
    ranks = [RankReport(rank=0, state=RankState.EXITED, exit_code=1, callsite=site,
                        note="ValueError: bad shape"),
             RankReport(rank=1, state=RankState.IN_COLLECTIVE,
                        collective=_coll("all_reduce", 3, [[8]], Frame(TRAIN, 40, "step")),
                        callsite=Frame(TRAIN, 40, "step"))]
    return Diagnosis(
        verdict=Verdict.CRASH, summary="Rank 0 raised ValueError: bad shape; rank 1 waits in "
                                       "all_reduce for it.",
        culprit_ranks=[0], ranks=ranks, artifacts="/tmp/runs/c",
        fix="Handle the empty batch before the collective.",
        fix_code="if x.numel() == 0:\n    x = x.new_zeros(1, x.shape[-1])\ny = dist_op(x)",
        culprit_basis=CulpritBasis.EXCEPTION, certainty=Certainty.LIKELY, rule="crashed")


def many_ranks_ragged(world: int = 64) -> Diagnosis:
    """Every rank a different size: one group per rank, summarised."""
    site = Frame(EP, 95, "naive_gather")
    per = {r: _coll("all_gather", 1, [[r + 1, 64]], site) for r in range(world)}
    d = ragged_repro(nproc=world, hint=HINT + A2A_REASON, recommended="a2a")
    d.first_divergence = Divergence(pg="0", seq=1, kind=MismatchKind.SIZE, pg_desc="default_pg",
                                    per_rank=dict(per))
    d.ranks = [RankReport(rank=r, state=RankState.IN_COLLECTIVE, collective=per[r],
                          callsite=site) for r in range(world)]
    d.culprit_ranks = list(range(world))
    return d


def ragged_four() -> Diagnosis:
    """The real 4-rank repro: four sizes, a long summary, a2a recommended."""
    d = many_ranks_ragged(4)
    sizes = [68, 401, 1607, 230]
    for r, n in enumerate(sizes):
        c = d.first_divergence.per_rank[r]  # type: ignore[union-attr]
        assert c is not None
        c.input_sizes = [[n, 64]]
    d.summary = (f"Ranks posted different sizes at seq 1 of default_pg at {EP}:95 naive_gather: "
                 + "; ".join(f"rank {r} all_gather({n}×64)" for r, n in enumerate(sizes))
                 + "; rank 0 killed by SIGABRT, rank 1 killed by SIGTERM, rank 2 killed by "
                   "SIGTERM, rank 3 killed by SIGTERM.")
    return d


def six_sites() -> Diagnosis:
    """Six ranks, six different lines: the first four shown, the rest counted."""
    ranks = [RankReport(rank=r, state=RankState.IN_COLLECTIVE,
                        collective=_coll("all_reduce", r + 1, [[8]]),
                        callsite=Frame(TRAIN, 10 * (r + 1), f"step{r}")) for r in range(6)]
    return Diagnosis(verdict=Verdict.HANG, summary="Every rank waits somewhere else.",
                     culprit_ranks=[5], ranks=ranks, artifacts="/tmp/runs/6")


def hang_eight() -> Diagnosis:
    """Ranks 0-6 wait in all_reduce at train.py:40; rank 7 computes elsewhere."""
    ar = Frame(TRAIN, 40, "step")
    ranks = [RankReport(rank=r, state=RankState.IN_COLLECTIVE,
                        collective=_coll("all_reduce", 7, [[8]]), callsite=ar) for r in range(7)]
    ranks.append(RankReport(rank=7, state=RankState.IDLE,
                            callsite=Frame(TRAIN, 88, "load_batch")))
    return Diagnosis(verdict=Verdict.HANG,
                     summary="Ranks 0-6 wait in all_reduce default_pg#7; rank 7 is blocked "
                             "outside any collective at train.py:88 load_batch.",
                     culprit_ranks=[7], ranks=ranks, artifacts="/tmp/runs/h",
                     culprit_basis=CulpritBasis.WAITED_FOR, fix="See what rank 7 waits for.")


def died() -> Diagnosis:
    ranks = [RankReport(rank=0, state=RankState.IN_COLLECTIVE,
                        collective=_coll("all_reduce", 5, [[8]]), callsite=Frame(TRAIN, 40, "s")),
             RankReport(rank=1, state=RankState.EXITED, exit_code=-9)]
    return Diagnosis(verdict=Verdict.RANK_DIED, summary="Rank 1 was killed by SIGKILL while "
                     "rank 0 waits in all_reduce.", culprit_ranks=[1], ranks=ranks,
                     artifacts="/tmp/runs/d", culprit_basis=CulpritBasis.EXITED)


def straggler() -> Diagnosis:
    ranks = [RankReport(rank=0, state=RankState.IN_COLLECTIVE,
                        collective=_coll("all_reduce", 5, [[8]]), callsite=Frame(TRAIN, 40, "s")),
             RankReport(rank=1, state=RankState.COMPUTING, callsite=Frame(TRAIN, 60, "slow"))]
    return Diagnosis(verdict=Verdict.STRAGGLER, summary="Rank 1 is still computing at "
                     "train.py:60 while rank 0 waits: slow, not a hang.", culprit_ranks=[1],
                     ranks=ranks, artifacts="/tmp/runs/s")


def healthy() -> Diagnosis:
    return Diagnosis(verdict=Verdict.HEALTHY, summary="Every rank finished.",
                     ranks=[RankReport(rank=r, state=RankState.EXITED, exit_code=0)
                            for r in range(2)], artifacts="/tmp/runs/ok",
                     run=WatchRun(command=["torchrun"], job_exit_code=0, detected="completed"))


def inconclusive() -> Diagnosis:
    return Diagnosis(verdict=Verdict.INCONCLUSIVE,
                     summary="No rank could be read: py-spy failed on every rank and no "
                             "Flight Recorder dump was found; run with --fr-dir or as root.",
                     ranks=[RankReport(rank=r, note="py-spy: permission denied")
                            for r in range(2)], artifacts="")


def unreadable_dump(world: int = 2, bad: tuple[int, ...] = (1,)) -> Diagnosis:
    """``moe-hang analyze`` of a dump set whose rank files in ``bad`` are truncated: what the
    real set gives (the ranks' reports say nothing of why; the evidence does)."""
    ranks = [RankReport(rank=r) if r in bad else RankReport(
        rank=r, state=RankState.IN_COLLECTIVE, collective=_coll("all_gather", 30, [[4, 8]]))
        for r in range(world)]
    known = [r for r in range(world) if r not in bad]
    return Diagnosis(
        verdict=Verdict.INCONCLUSIVE, certainty=Certainty.UNCERTAIN, rule="inconclusive",
        summary=f"Not enough evidence to name a cause: states known for {who(known)} only.",
        ranks=ranks, artifacts="/tmp/dumps",
        evidence=["Flight Recorder dumps /tmp/dumps/comm_lib_trace_rank_<rank>: "
                  f"{len(known)} read (format 2.10, gloo)",
                  *(f"rank {r}: Flight Recorder dump unreadable (comm_lib_trace_rank_{r}: "
                    "truncated or corrupt pickle (pickle data was truncated))" for r in bad)])


def verified() -> Diagnosis:
    ref = ReferenceReport(ok=True, max_abs_err=6.98e-10, max_rel_err=4.37e-7, rtol=1e-5,
                          compared=60, steps=3)
    return Diagnosis(verdict=Verdict.HEALTHY,
                     summary="Fixed (varlen): all 3 steps completed on 2 ranks; outputs, loss "
                             "and every LoRA gradient match the single-process reference.",
                     ranks=[RankReport(rank=r, state=RankState.EXITED, exit_code=0)
                            for r in range(2)], artifacts="/tmp/runs/v",
                     run=_scenario("fixed", verified=True, reference=ref,
                                   hint="varlen (moe_hang.VarlenDispatch): exchange lengths"))


def not_verified() -> Diagnosis:
    d = ragged_repro()
    d.run = _scenario("fixed", verified=False, hint="varlen (moe_hang.VarlenDispatch)",
                      reference=ReferenceReport(ok=False, failures=["rank 0 step 1 loss"]))
    return d


def _nccl(kind: str) -> Diagnosis:
    """NCCL's evidence through the real engine: recorder dumps of a symmetric hang
    (tests/unit/fixtures/fr_started) and RAS reports (tests/unit/fixtures/ras)."""
    import tempfile

    from conftest import FIXTURES, make_fr_set

    from moe_hang.analysis.rules import diagnose
    from moe_hang.evidence.flight_recorder.postmortem import evidence, find, load_sets
    from moe_hang.evidence.model import Evidence
    from moe_hang.evidence.ras import RasPoll
    from moe_hang.evidence.ras_files import attach_ras, read_ras_files

    ras = FIXTURES / "ras"

    def dumps(path: Path) -> Evidence:
        ev = evidence(load_sets(find([path]).sets))
        ev.artifacts = str(path)
        return ev

    def frozen4() -> list[RasPoll]:
        return read_ras_files([ras / f"symmetric_hang_1node_poll{i}.json" for i in (1, 2)])

    if kind == "transport":
        ev = dumps(FIXTURES / "fr_started" / "json")
        attach_ras(ev, frozen4())
    elif kind == "transport-no-timing":
        ev = dumps(FIXTURES / "fr_started" / "no_timing")
    elif kind == "transport-late":
        ev = dumps(FIXTURES / "fr_started" / "json")
        fr = ev.ranks[2].fr
        assert fr is not None
        for c in fr.entries:
            if c.state == "started" and c.time_started_ns is not None:
                c.time_started_ns += 3_000_000_000
        attach_ras(ev, frozen4())
    elif kind == "transport-16":
        with tempfile.TemporaryDirectory(prefix="moe-hang-test-") as tmp:
            make_fr_set(Path(tmp), "--ranks", "16", "--mesh", "4x4", "--entries", "40",
                        "--fault", "stall", "--frames")
            return diagnose(dumps(Path(tmp)))
    elif kind == "ras-desync":
        ev = Evidence(ranks={}, artifacts="ras/frozen_mismatch_poll*.json")
        attach_ras(ev, read_ras_files([ras / "frozen_mismatch_poll1.json",
                                       ras / "frozen_mismatch_poll2.json"]))
    else:
        ev = Evidence(ranks={}, artifacts="ras/dead_rank_2.29.7.json")
        attach_ras(ev, read_ras_files([ras / "dead_rank_2.29.7.json"]))
    return diagnose(ev)


CASES = {
    "analyze-transport-hang": (lambda: _nccl("transport"),
                               ReportContext("analyze", "moe-hang analyze")),
    "analyze-transport-no-timing": (lambda: _nccl("transport-no-timing"),
                                    ReportContext("analyze", "moe-hang analyze")),
    "analyze-transport-late": (lambda: _nccl("transport-late"),
                               ReportContext("analyze", "moe-hang analyze")),
    "analyze-transport-16": (lambda: _nccl("transport-16"),
                             ReportContext("analyze", "moe-hang analyze")),
    "analyze-ras-desync": (lambda: _nccl("ras-desync"),
                           ReportContext("analyze", "moe-hang analyze")),
    "analyze-ras-dead": (lambda: _nccl("ras-dead"), ReportContext("analyze", "moe-hang analyze")),
    "repro-desync": (ragged_repro, ReportContext("repro", "moe-hang repro",
                                                 ["moe-hang", "verify", "--fixed"])),
    "repro-a2a-64-ranks": (many_ranks_ragged, ReportContext(
        "repro", "moe-hang repro", ["moe-hang", "verify", "--fixed", "--nproc", "64",
                                    "--fix", "a2a"])),
    "repro-4-ranks": (ragged_four, ReportContext(
        "repro", "moe-hang repro", ["moe-hang", "verify", "--fixed", "--nproc", "4",
                                    "--fix", "a2a"])),
    "diagnose-6-sites": (six_sites, ReportContext("diagnose", "moe-hang diagnose 6")),
    "repro-ruled-out": (lambda: _with_run(healthy(), _scenario(reproduced=False)),
                        ReportContext("repro", "moe-hang repro", ["moe-hang", "verify"])),
    "verify-regression": (lambda: ragged_repro(verified=True, reproduced=True),
                          ReportContext("verify", "moe-hang verify")),
    "verify-fixed": (verified, ReportContext("verify", "moe-hang verify --fixed")),
    "verify-fixed-failed": (not_verified, ReportContext("verify", "moe-hang verify --fixed")),
    "watch-desync": (skipped_collective, ReportContext("watch", "moe-hang watch")),
    "watch-subgroup": (subgroup_missing, ReportContext("watch", "moe-hang watch")),
    "watch-crash-code": (crash_with_code, ReportContext("watch", "moe-hang watch")),
    "watch-died": (died, ReportContext("watch", "moe-hang watch")),
    "watch-straggler": (straggler, ReportContext("watch", "moe-hang watch")),
    "watch-healthy": (healthy, ReportContext("watch", "moe-hang watch")),
    "diagnose-hang-8": (hang_eight, ReportContext("diagnose", "moe-hang diagnose 4242")),
    "diagnose-inconclusive": (inconclusive, ReportContext("diagnose", "moe-hang diagnose 42")),
    "analyze-desync": (lambda: skipped_collective(world=16, culprit=5),
                       ReportContext("analyze", "moe-hang analyze")),
    "analyze-unreadable-dump": (unreadable_dump, ReportContext("analyze", "moe-hang analyze")),
    "analyze-unreadable-dumps-16": (lambda: unreadable_dump(16, (3, 7, 8, 9)),
                                    ReportContext("analyze", "moe-hang analyze")),
}


def _with_run(d: Diagnosis, run: ScenarioRun) -> Diagnosis:
    d.run = run
    return d


def _case(name: str) -> tuple[Diagnosis, ReportContext]:
    make, ctx = CASES[name]
    return make(), ctx


def _render(d: Diagnosis, ctx: ReportContext, width: int, verbose: bool = False) -> str:
    buf = io.StringIO()
    render(d, Console(file=buf, width=width, color_system=None, soft_wrap=True), ctx,
           verbose=verbose)
    return buf.getvalue()


def _tokens(text: str) -> set[str]:
    return set(text.split())


# ----------------------------------------------------------------------------- one screen


@pytest.mark.parametrize("name", sorted(CASES))
def test_first_screen_fits_15_rows_at_80_columns(name):
    d, ctx = _case(name)
    out = _render(d, ctx, 80)
    rows = screen_lines(out.splitlines(), 80)
    assert rows <= MAX_LINES, f"{rows} rows:\n{out}"
    assert all(len(line) <= 80 for line in out.splitlines()), out
    assert ctx.title in out.splitlines()[0]


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("verbose", [False, True])
def test_no_word_is_broken_at_80_columns(name, verbose):
    """Every word of the 80-column report is a whole word of the same report rendered with no
    width limit (where nothing wraps): wrapping broke no word, no path."""
    d, ctx = _case(name)
    narrow = _tokens(_render(d, ctx, 80, verbose))
    wide = _tokens(_render(d, ctx, 100_000, verbose))
    # said only at narrow widths: a clipped line (and the detail repeating it in full),
    # columns of the timeline left out
    extra = {"…"} | _tokens("in full (5 more sequence numbers in console.log and the HTML)")
    for members, phrase, _ in site_groups(d, merge_sizes=True):  # shortened to fit
        extra |= _tokens(f"{who(members)} {phrase}")
    broken = {t for t in narrow - wide - extra if not t.isdigit() and not t.startswith("(")}
    assert not broken, broken


def test_the_first_screen_has_the_answer_and_nothing_else():
    d, ctx = _case("watch-desync")
    out = _render(d, ctx, 80)
    lines = out.splitlines()
    assert lines[0] == "moe-hang watch: DESYNC"  # definite: no certainty shown
    assert "culprit: rank 1 (it differs from the majority at the divergence)" in out
    assert "rank 1 in barrier default_pg#7 at train.py:23 <module>" in out
    assert "rank 0 in all_gather default_pg#7 [4×8] at train.py:15 dispatch" in out
    assert "fix: Make every rank post every collective" in out
    assert "next: open train.py:23 (<module>, rank 1)" in out
    assert lines[-1].startswith("run directory /tmp/runs/w")
    for detail in ("stacks", "evidence", "collectives of default_pg", "pid"):
        assert detail not in out
    verbose = _render(d, ctx, 80, verbose=True)
    for detail in ("stacks", "collectives of default_pg", "first divergence: op_mismatch"):
        assert detail in verbose


def test_many_ranks_are_grouped_by_call_site():
    d, ctx = _case("diagnose-hang-8")
    out = _render(d, ctx, 80)
    assert "rank 7 idle at train.py:88 load_batch" in out
    assert "ranks 0-6 in all_reduce default_pg#7 [8] at train.py:40 step" in out
    # the culprit's group comes first
    assert out.index("rank 7 idle") < out.index("ranks 0-6")
    d, ctx = _case("analyze-desync")
    out = _render(d, ctx, 80)
    assert "ranks 0-4, 6-15 in all_gather" in out and "rank 5 in barrier" in out


def test_sixty_four_different_sizes_are_summarised():
    d, ctx = _case("repro-a2a-64-ranks")
    out = _render(d, ctx, 80)
    assert ("ranks 0-63 in all_gather default_pg#1 at moe_hang/scenarios/ep.py:95\n"
            "    naive_gather (64 different sizes)") in out
    assert "next: moe-hang verify --fixed --nproc 64 --fix a2a" in out


def test_sizes_merge_before_ranks_are_left_out():
    out = _render(*_case("repro-4-ranks"), 80)
    assert "ranks 0-3 in all_gather default_pg#1 at moe_hang/scenarios/ep.py:95" in out
    assert "(4 different sizes)" in out and "more rank(s)" not in out
    out = _render(*_case("diagnose-6-sites"), 80)
    assert out.index("rank 5 in all_reduce default_pg#6 [8] at train.py:60 step5") < \
        out.index("rank 0 in all_reduce")
    assert "… and 2 more rank(s) in 2 other place(s) (--verbose)" in out


def test_a_rank_whose_evidence_is_unreadable_says_why_on_the_first_screen():
    """Issue 18, case 6: not only "state unknown" — why, on the first screen; ranks whose
    files failed alike are one line (their file names are left out: the ranks say whose)."""
    out = _render(*_case("analyze-unreadable-dump"), 80)
    assert ("rank 1 state unknown: Flight Recorder dump unreadable (truncated or corrupt\n"
            "    pickle (pickle data was truncated))") in out, out
    assert "\nevidence\n" not in out  # the detail section stays under --verbose
    out = _render(*_case("analyze-unreadable-dumps-16"), 80)
    assert "ranks 3, 7-9 state unknown: Flight Recorder dump unreadable" in out, out
    assert "comm_lib_trace_rank_" not in out.split("captures")[0]


def test_a_truncated_real_dump_says_why_its_rank_is_unknown(fixtures, tmp_path):
    """The real gloo dumps of tests/unit/fixtures/fr_real/world2_skip, rank 1's cut in half
    (its writer died mid-dump): analyze's first screen says why rank 1 is unknown."""
    from moe_hang.commands.diagnose import analyze_paths

    shutil.copytree(fixtures / "fr_real" / "world2_skip" / "pickle", tmp_path / "dumps")
    bad = tmp_path / "dumps" / "comm_lib_trace_rank_1"
    bad.write_bytes(bad.read_bytes()[: bad.stat().st_size // 2])
    d = analyze_paths([tmp_path / "dumps"], force=False)
    screen = first_screen(d, ReportContext("analyze", "moe-hang analyze"), 80)
    out = "\n".join(line.plain for line in screen.lines)
    assert len(screen.lines) <= MAX_LINES and all(len(x.plain) <= 80 for x in screen.lines)
    flat = " ".join(out.split())
    assert "rank 1 state unknown: Flight Recorder dump unreadable (truncated or corrupt " \
           "pickle" in flat, out


def test_certainty_is_shown_when_the_verdict_engine_set_it():
    d, ctx = _case("watch-subgroup")
    assert _render(d, ctx, 80).splitlines()[0] == "moe-hang watch: DESYNC (likely)"
    d.rule = ""  # the schema's default certainty, not a judgement: not shown
    assert _render(d, ctx, 80).splitlines()[0] == "moe-hang watch: DESYNC"
    out = _render(*_case("watch-subgroup"), 80)
    assert "rank 3 never posted all_reduce ep_group#4; in barrier" in out
    assert "culprit: rank 3 (it went past what the others wait in)" in out


def test_fix_code_is_printed_as_is_to_paste():
    d, ctx = _case("watch-crash-code")
    out = _render(d, ctx, 80)
    assert "    if x.numel() == 0:\n        x = x.new_zeros(1, x.shape[-1])\n    y = " in out
    assert "(it raised the first exception" in out
    assert out.splitlines()[0] == "moe-hang watch: CRASH (likely)"
    # a site-packages path loses its prefix and stays whole
    assert "mylib/deeply/nested/package/module_with_a_long_name.py:1234" in out
    assert SITE not in out


def test_verify_regression_check_is_not_a_red_desync():
    d, ctx = _case("verify-regression")
    out = _render(d, ctx, 80)
    assert out.splitlines()[0] == ("moe-hang verify: regression check passed: the broken "
                                   "variant still reproduces")
    assert "DESYNC" not in out and "fix:" not in out and "next:" not in out
    assert "rank 0 in all_gather default_pg#1 [68×64]" in out  # what it reproduced
    first = first_screen(d, ctx, 80).lines[0]
    assert [str(s.style) for s in first.spans] == ["bold green"]


def test_verified_fix_says_only_where_the_run_is():
    d, ctx = _case("verify-fixed")
    out = _render(d, ctx, 80)
    assert out.splitlines()[0] == "moe-hang verify --fixed: VERIFIED"
    assert "next:" not in out and "fix under test: varlen" in out
    assert out.splitlines()[-1].startswith("run directory /tmp/runs/v")
    out = _render(*_case("verify-fixed-failed"), 80)
    assert out.splitlines()[0] == "moe-hang verify --fixed: NOT VERIFIED (desync)"
    assert "next: open moe_hang/scenarios/ep.py:95 (naive_gather, rank 0)" in out


def test_repro_next_command_and_ruled_out():
    out = _render(*_case("repro-desync"), 80)
    assert "next: moe-hang verify --fixed\n" in out
    out = _render(*_case("repro-ruled-out"), 80)
    assert out.splitlines()[0] == "moe-hang repro: HEALTHY (not reproduced)"
    assert "next:" not in out and "fix:" not in out


def test_clipped_sections_come_back_in_full_in_the_detail():
    d, ctx = _case("repro-a2a-64-ranks")
    screen = first_screen(d, ctx, 80)
    assert screen.clipped and screen.lines[-1].plain.startswith("run directory")
    log = render_text(d, ctx, width=80)
    assert "prove it with moe-hang verify --fixed --fix a2a." in " ".join(log.split())


def test_next_verify_command_repeats_the_users_scenario_options():
    defaults = {"scenario": "ep-ragged", "nproc": None, "tokens": None, "stall": 3.0,
                "out": None, "as_json": False, "html": None, "verbose": False,
                "port": None, "lora_outside_fsdp": False}
    given = dict(defaults, scenario="fsdp-skip", nproc=4, out=Path("r"), as_json=True,
                 port=29500, verbose=True, lora_outside_fsdp=True)
    assert next_verify_command(given, defaults, None) == [
        "moe-hang", "verify", "--fixed", "--scenario", "fsdp-skip", "--nproc", "4",
        "--lora-outside-fsdp"]
    run = _scenario(recommended="a2a")
    assert next_verify_command(defaults, defaults, run)[-2:] == ["--fix", "a2a"]


# ----------------------------------------------------------------------------- wrapping


def test_wrap_breaks_only_at_whitespace_and_keeps_long_words_whole():
    long = "moe_hang/" + "x" * 100 + ".py:1"
    lines = [t.plain for t in wrap(f"in in_collective at {long} fn", 40, indent=2, hang=4)]
    assert lines == ["  in in_collective at", f"    {long}", "    fn"]
    assert screen_lines(lines, 40) == 1 + 3 + 1
    assert [t.plain for t in wrap("a b\n\nc", 10)] == ["a b", "", "c"]


def test_paths_in_sentences_are_shortened_never_split():
    text = f"at {CWD}/moe_hang/worker.py:3 and {SITE}/torch/x.py:1 and /elsewhere/y.py:2"
    assert shorten_paths(text) == "at moe_hang/worker.py:3 and torch/x.py:1 and /elsewhere/y.py:2"


def test_rank_lists_are_written_one_way():
    assert spans([0, 1, 2, 4, 6, 7]) == "0-2, 4, 6, 7"
    assert spans([7, 6, 0, 1, 2, 3, 8, 10, 11]) == "0-3, 6-8, 10, 11"
    assert who([3]) == "rank 3" and who([0, 1]) == "ranks 0, 1" and who(range(8)) == "ranks 0-7"
    assert who(range(0, 600, 2)) == "300 ranks"  # scattered thousands: by their number
    assert agree([1], "waits", "wait") == "waits" and agree([1, 2], "waits", "wait") == "wait"


# ----------------------------------------------------------------------------- HTML


class _Page(HTMLParser):
    """Tags (with attributes) and the text inside each element with an id or class."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str]]] = []
        self.text: list[tuple[list[str], str]] = []
        self._open: list[str] = []

    def handle_starttag(self, tag, attrs):
        a = {k: v or "" for k, v in attrs}
        self.tags.append((tag, a))
        self._open.append(f"{tag}.{a.get('class', '')}#{a.get('id', '')}")

    def handle_endtag(self, tag):
        while self._open and not self._open.pop().startswith(tag + "."):
            pass

    def handle_data(self, data):
        self.text.append((list(self._open), data))

    def inside(self, marker: str) -> str:
        return "".join(d for stack, d in self.text if any(marker in s for s in stack))

    def find(self, tag: str, cls: str | None = None) -> list[dict[str, str]]:
        return [a for t, a in self.tags if t == tag and (cls is None or
                                                          cls in a.get("class", "").split())]


def _page(d: Diagnosis, ctx: ReportContext, page: Path) -> _Page:
    p = _Page()
    p.feed(to_html(d, ctx, page))
    p.close()
    return p


def test_html_has_every_part(tmp_path):
    d, ctx = _case("watch-desync")
    run = tmp_path / "run"
    (run / "ranks").mkdir(parents=True)
    (run / "diagnosis.json").write_text("{}")
    (run / "ranks" / "rank 0.fr.pkl").write_bytes(b"x")
    d.artifacts = str(run)
    d.evidence = ["RuntimeError: Connection closed by peer"]
    p = _page(d, ctx, run / "report.html")
    assert p.inside("title") == "moe-hang watch: DESYNC"
    assert p.inside("#verdict") == "moe-hang watch: DESYNC"
    assert "Ranks posted different collectives at seq 7" in p.inside("summary")
    assert "rank 1" in p.inside("culprits") and "majority" in p.inside("culprits")
    assert "rank 1 in barrier default_pg#7 at train.py:23" in p.inside("li.culprit")
    assert "Make every rank post every collective" in p.inside("p.fix")
    assert "open train.py:23" in p.inside("p.next")
    assert len(p.find("tr", None)) >= 3
    ranks_rows = p.inside("table.ranks")
    assert "in_collective" in ranks_rows and "train.py:15 dispatch" in ranks_rows
    # the timeline: one marked column, marked in the header and in every rank's row
    assert len(p.find("th", "diverge")) == 1 and len(p.find("td", "diverge")) == 2
    assert p.inside("th.diverge") == "▶7"
    assert len(p.find("details", "stack")) == 2 and "rank 0" in p.inside("summary.")
    assert "Connection closed by peer" in p.inside("ul.evidence")
    hrefs = [a["href"] for a in p.find("a")]
    assert "diagnosis.json" in hrefs and "ranks/rank%200.fr.pkl" in hrefs  # relative, quoted
    assert "report.html" not in hrefs
    # self-contained: no script, no stylesheet or image from anywhere
    assert not p.find("script") and not p.find("link") and not p.find("img")
    assert not [h for h in hrefs if h.startswith(("http:", "https:", "//"))]


def test_html_heat_map_beside_the_grid_and_unknown_cells(tmp_path):
    from moe_hang.analysis.diagnosis import TimelineCell
    from moe_hang.analysis.routing import ExpertGap, RoutingReport

    d, ctx = _case("watch-desync")
    d.routing = RoutingReport(2, [ExpertGap(2, "model.layers.1.mlp", 0, 2, {0: 5, 1: 0},
                                            {0: 16, 1: 16})],
                              counts={0: {"model.layers.1.mlp": [9, 9, 5, 9]},
                                      1: {"model.layers.1.mlp": [12, 10, 0, 10]}})
    assert d.timeline is not None
    d.timeline.ranks[1][0] = TimelineCell("?", [], "unknown")
    p = _page(d, ctx, tmp_path / "report.html")
    assert len(p.find("div", "pair")) == 1  # the grid and the heat map side by side
    assert "tokens per expert at step 2" in p.inside("h2.#routing")
    assert p.inside("td.starved") == "0"  # rank 1's expert 2, outlined
    assert "rank 1 routed 0 of 16 tokens to model.layers.1.mlp expert 2" in p.inside(
        "ul.evidence")
    assert p.inside("td.unknown") == "?"  # posted, not in its evidence: not "missing"


def test_html_heat_map_names_blocks_by_what_differs():
    from moe_hang.report.html import _common_part

    blocks = ["model.layers.0.block_sparse_moe", "model.layers.1.block_sparse_moe"]
    assert _common_part(blocks) == ("model.layers.*.block_sparse_moe",
                                    {blocks[0]: "0", blocks[1]: "1"})
    assert _common_part(["model.layers.1.mlp"]) == ("block", {"model.layers.1.mlp":
                                                              "model.layers.1.mlp"})
    assert _common_part(["a.x", "b.y"]) == ("block", {"a.x": "a.x", "b.y": "b.y"})
    # a name that is all prefix of another keeps one part of its own
    assert _common_part(["m.e", "m.e.lora"])[1] == {"m.e": "e", "m.e.lora": "e.lora"}


def test_html_outside_the_run_directory_links_absolute_files(tmp_path):
    d, ctx = _case("repro-desync")
    run = tmp_path / "run"
    run.mkdir()
    (run / "job.log").write_text("x")
    d.artifacts = str(run)
    p = _page(d, ctx, tmp_path / "elsewhere" / "r.html")
    assert (run / "job.log").resolve().as_uri() in [a["href"] for a in p.find("a")]
    assert "size_mismatch" not in p.inside("#verdict")
    assert "single-process reference" not in p.inside("h2")


def test_html_escapes_everything_the_job_wrote(tmp_path):
    d, ctx = _case("watch-crash-code")
    evil = '<script>alert("x")</script><img src=x onerror=alert(1)>'
    d.summary = f"Rank 0 raised {evil}"
    d.evidence = [evil]
    d.ranks[0].stack = [f"{evil}:1 f"]
    d.ranks[0].note = evil
    d.fix_code = evil
    p = _page(d, ctx, tmp_path / "r.html")
    assert not p.find("script") and not p.find("img")
    assert evil in p.inside("summary") and evil in p.inside("ul.evidence")
    assert evil in p.inside("pre.fix-code")


def test_html_reference_and_verify(tmp_path):
    p = _page(*_case("verify-fixed"), tmp_path / "r.html")
    assert p.inside("#verdict") == "moe-hang verify --fixed: VERIFIED"
    assert "match" in p.inside("td.good") and "6.980e-10" in p.inside("table")


def test_console_log_holds_everything_at_a_fixed_width():
    d, ctx = _case("repro-desync")
    log = render_text(d, ctx)
    for part in ("moe-hang repro: DESYNC", "first divergence: size_mismatch", "ranks",
                 "collectives of default_pg", "stacks", "evidence", "wall 8.0 s",
                 "tokens 68 local · experts 37/37/29/33", "Received data size"):
        assert part in log, part
    assert "[enforce fail" not in log and "(details: --verbose" not in log
    assert max(len(x) for x in log.splitlines()) <= 120
    assert re.search(r"run directory /tmp/runs/x-ep-ragged$", log, re.M)


def test_a_long_timeline_shows_the_diverging_column_and_its_neighbours():
    d, ctx = _case("watch-desync")
    d.timeline = _timeline(2, list(range(1, 41)), 40)
    out = _render(d, ctx, 80, verbose=True)
    header = next(line for line in out.splitlines() if "▶40" in line)
    assert header.split()[0] == "rank" and len(header) <= 80
    assert "more sequence numbers in console.log and the HTML)" in out
    wide = render_text(d, ctx, width=400)
    assert "more sequence numbers" not in wide and " 1 " in next(
        line for line in wide.splitlines() if "▶40" in line)


@pytest.mark.parametrize("source, want", [
    ("probe", "killed by SIGKILL (last seen at train.py:31 <module>)"),
    ("faulthandler (fatal signal)", "killed by SIGKILL at train.py:31 <module>")])
def test_a_killed_ranks_line_from_a_heartbeat_sample_is_where_it_was_last_seen(source, want):
    """A SIGKILL leaves no stack: the line of a killed rank whose stack is its heartbeat's
    last sample (taken while it ran) is where it was last seen, not where it died."""
    from moe_hang.analysis.diagnosis import RankReport
    from moe_hang.report.words import where_now

    r = RankReport(rank=1, state=RankState.EXITED, exit_code=-9, stack_source=source,
                   callsite=Frame("train.py", 31, "<module>"))
    assert where_now(r) == want


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_long_run_directory_and_a_routing_line_still_fit(name):
    """The run line loses its details hint before any line of the answer; a routing line
    (the data decision) takes its place beside the sites, whole; the fitting ends."""
    from moe_hang.analysis.routing import ExpertGap, RoutingReport

    d, ctx = _case(name)
    d.artifacts = "/tmp/pytest-of-someone/pytest-1234/popen-gw1/test_a_long_name_of_a_test_0/w"
    d.routing = RoutingReport(2, [ExpertGap(2, "model.layers.1.block_sparse_moe", 0, 2,
                                            {0: 8, 1: 0}, {0: 16, 1: 16})])
    out = _render(d, ctx, 80)
    assert screen_lines(out.splitlines(), 80) <= MAX_LINES, out
    text = " ".join(line.strip() for line in out.splitlines())
    sentence = d.routing_sentence()
    if "routing:" in text and sentence:  # beside a problem only; then whole
        assert " ".join(sentence.split()) in text, out


def test_the_summary_outlasts_the_fix_prose_when_the_screen_is_full():
    """repro's ragged gather with its routing line and a long run directory: of two sections
    as long, the later one (the fix's prose, in full in the detail) is shortened first, so the
    summary's sizes stay on the first screen (CI caught them clipped off)."""
    from moe_hang.analysis.routing import RoutingReport, TokenGap

    d, ctx = _case("repro-desync")
    d.artifacts = "/tmp/pytest-of-root/pytest-263/test_repro_answer_fits_one_scr0/run"
    d.routing = RoutingReport(0, ragged=[TokenGap(0, "layers.0", 0, {0: 68, 1: 401})])
    out = _render(d, ctx, 80)
    assert screen_lines(out.splitlines(), 80) <= MAX_LINES, out
    summary = d.summary.split(":")[-1]
    assert all(word in out for word in summary.split() if "×" in word), out
    assert "routing: rank 0 and rank 1 sent 68 and 401 tokens" in out


# --- the next step where the evidence does not decide ----------------------------------------

def _undecided(sites: dict[int, Frame]) -> Diagnosis:
    return Diagnosis(Verdict.DESYNC, "s", culprit_ranks=sorted(sites),
                     ranks=[RankReport(r, callsite=f) for r, f in sites.items()],
                     culprit_basis=CulpritBasis.AMBIGUOUS)


@pytest.mark.parametrize("command, want", [
    ("diagnose", ("moe-hang watch -- <the job's launch command>",
                  "the Flight Recorder history decides between ranks 0, 1")),
    ("analyze", ("open /j/train.py:35 and /j/train.py:55", "where ranks 0, 1 are"))])
def test_an_undecided_verdict_picks_no_rank_for_the_next_step(command, want):
    """Stacks alone, two ranks at two lines, neither decided: "next" opened rank 0's line
    (the lowest number); it now names what decides (diagnose) or every line."""
    d = _undecided({0: Frame("/j/train.py", 35, "exchange"), 1: Frame("/j/train.py", 55, "m")})
    assert next_words(d, ReportContext(command=command, title="t")) == want
    # the same with the ranks' numbers swapped: the same next step
    d = _undecided({1: Frame("/j/train.py", 35, "exchange"), 0: Frame("/j/train.py", 55, "m")})
    got = next_words(d, ReportContext(command=command, title="t"))
    assert got is not None and (command == "diagnose" or set(got[0].split()) ==
                                set(want[0].split()))


def test_an_undecided_verdict_at_one_line_opens_it():
    d = _undecided({0: Frame("/j/ep.py", 95, "gather"), 1: Frame("/j/ep.py", 95, "gather")})
    assert next_words(d, ReportContext(command="analyze", title="t")) == (
        "open /j/ep.py:95", "gather, ranks 0, 1")


def test_the_routing_line_gives_its_second_row_only_when_nothing_else_can():
    """Kept whole (two rows at 80 columns) while another section can shorten; at the very
    end, when only it can, clipped to one row rather than a 16th row on the screen."""
    from moe_hang.report import screen

    long = screen.wrap(screen.Text("routing: " + "word " * 20), 80, hang=2)
    assert len(long) == 2
    fixed = [screen._Section([screen.Text(f"line {i}")]) for i in range(14)]
    routing = screen._clippable(list(long), 80, keep=2)
    routing.last = lambda: screen.clip(routing.lines, 1, 80)
    clipped = screen._fit([*fixed, routing], 80)
    assert clipped and len(routing.lines) == 1  # 14 + 1: the last resort was taken
    spare = screen._clippable([screen.Text(f"more {i}") for i in range(3)], 80, keep=1)
    routing = screen._clippable(list(long), 80, keep=2)
    routing.last = lambda: screen.clip(routing.lines, 1, 80)
    screen._fit([*fixed[:11], spare, routing], 80)
    assert len(routing.lines) == 2 and len(spare.lines) == 2  # another section gave way


def test_a_rank_past_the_divergence_posted_it_and_is_not_in_it():
    """A silent mispairing: rank 0 posted expert 2's all-gather at seq 59 and went on (it now
    waits in seq 61); it is said to have posted #59, not to be in it, which the rank table
    (seq 61) would contradict. A rank still waiting in the diverging collective is in it."""
    loop = Frame(f"{CWD}/modeling_mixtral.py", 133, "forward")
    step = Frame(TRAIN, 20, "<module>")
    at59 = _coll("all_gather", 59, [[1056]], loop)
    ranks = [RankReport(rank=0, pid=1, state=RankState.IN_COLLECTIVE, callsite=step,
                        collective=_coll("all_gather", 61, [[1056]], step)),
             RankReport(rank=1, pid=2, state=RankState.IN_COLLECTIVE, callsite=step,
                        collective=_coll("all_reduce", 61, [[576]], step))]
    d = Diagnosis(verdict=Verdict.DESYNC, summary="s", culprit_ranks=[1], ranks=ranks,
                  first_divergence=Divergence(pg="0", seq=59, kind=MismatchKind.OP,
                                              pg_desc="default_pg",
                                              per_rank={0: at59, 1: None}))
    phrases = {tuple(m): p for m, p, _ in site_groups(d)}
    assert phrases[(0,)].startswith("posted all_gather default_pg#59")
    assert phrases[(1,)].startswith("never posted all_gather default_pg#59; in all_reduce")
    ranks[0].collective = at59  # still waiting in it
    assert {tuple(m): p for m, p, _ in site_groups(d)}[(0,)].startswith("in all_gather")
