"""The data decision (analysis/routing.py) and moe-hang check's plans and first screen, from
records alone."""

from __future__ import annotations

from pathlib import Path

import pytest
from rich.text import Text

from moe_hang.analysis.diagnosis import Diagnosis, Verdict
from moe_hang.analysis.plans import CheckResult, Found, PlanResult, plans_for
from moe_hang.analysis.routing import (
    RoutingReport,
    gap_sentence,
    routing_report,
    routing_sentence,
)
from moe_hang.analysis.runs import ReferenceReport
from moe_hang.evidence.model import Evidence, RankEvidence
from moe_hang.evidence.routing import RouterCall
from moe_hang.report.check import check_screen
from moe_hang.report.wrap import screen_lines

L0, L1 = "model.layers.0.block_sparse_moe", "model.layers.1.block_sparse_moe"


def _calls(step: int, l0: tuple[int, ...], l1: tuple[int, ...], planned: bool = False
           ) -> list[RouterCall]:
    return [RouterCall(step, L0, 0, 16, l0, 2, planned),
            RouterCall(step, L1, 0, 16, l1, 2, planned)]


def _ev(by_rank: dict[int, list[RouterCall]]) -> Evidence:
    return Evidence(ranks={r: RankEvidence(rank=r, routing=c) for r, c in by_rank.items()})


@pytest.mark.parametrize("starved", [0, 1])  # mirrored: the starved rank swaps
def test_the_expert_one_rank_starved_at_the_last_common_step(starved: int) -> None:
    fed = 1 - starved
    ev = _ev({starved: _calls(1, (8, 8, 8, 8), (8, 8, 8, 8)) + _calls(2, (8, 8, 8, 8),
                                                                     (12, 10, 0, 10)),
              fed: _calls(1, (8, 8, 8, 8), (8, 8, 8, 8)) + _calls(2, (8, 8, 8, 8),
                                                                (9, 9, 5, 9))})
    report = routing_report(ev)
    assert report is not None and report.step == 2
    assert [(g.block, g.expert, g.starved) for g in report.gaps] == [(L1, 2, [starved])]
    text = gap_sentence(report.gaps[0], [starved])
    assert text == (f"rank {starved} routed 0 of 16 tokens to {L1} expert 2 at step 2 "
                    f"(rank {fed}: 5 of 16)")
    assert report.counts[starved][L1] == [12, 10, 0, 10]


def test_a_rank_a_step_behind_is_compared_at_its_step() -> None:
    ev = _ev({0: _calls(2, (8, 8, 8, 8), (8, 8, 8, 8)) + _calls(3, (16, 16, 0, 0), (8,) * 4),
              1: _calls(1, (8,) * 4, (8,) * 4) + _calls(2, (8, 8, 0, 16), (8,) * 4)})
    report = routing_report(ev)
    assert report is not None and report.step == 2
    assert [(g.block, g.expert, g.starved) for g in report.gaps] == [(L0, 2, [1])]


def test_no_gap_when_every_rank_fed_every_expert_and_none_without_counts() -> None:
    ev = _ev({0: _calls(0, (8,) * 4, (8,) * 4), 1: _calls(0, (8,) * 4, (8,) * 4)})
    report = routing_report(ev)
    assert report is not None and report.gaps == []
    assert routing_report(_ev({0: [], 1: []})) is None


def test_a_culprit_that_fed_the_expert_the_others_starved_is_the_subject() -> None:
    ev = _ev({0: _calls(0, (8,) * 4, (16, 16, 0, 0)), 1: _calls(0, (8,) * 4, (8,) * 4),
              2: _calls(0, (8,) * 4, (16, 0, 16, 0))})
    report = routing_report(ev)
    assert report is not None
    gap = next(g for g in report.gaps if g.expert == 2)
    assert gap_sentence(gap, [1]).startswith(f"rank 1 routed 8 of 16 tokens to {L1} expert 2")


def test_the_report_survives_the_diagnosis_json() -> None:
    ev = _ev({0: _calls(0, (8,) * 4, (16, 16, 0, 0), planned=True),
              1: _calls(0, (8,) * 4, (8,) * 4)})
    d = Diagnosis(verdict=Verdict.HANG, summary="s", culprit_ranks=[0],
                  routing=routing_report(ev))
    back = Diagnosis.from_dict(d.to_dict())
    assert back.routing == d.routing and back.routing is not None
    assert back.routing.gaps[0].planned == (0,)
    assert "moe-hang check's plan" in gap_sentence(back.routing.gaps[0], [0])
    assert RoutingReport.from_dict({"step": "x"}) is None


def test_plans_cover_every_expert_the_mirror_ragged_counts_and_a_crowd() -> None:
    plans = plans_for(Found(world=2, steps=3, blocks=[L0, L1], experts=4), max_plans=8)
    assert [p.name for p in plans] == ["starve-e0-r1", "starve-e0-r0", "ragged-r1",
                                       "no-token-r1", "starve-e1-r1", "starve-e2-r1",
                                       "starve-e3-r1", "all-to-e0-r1"]
    assert {p.step for p in plans} == {1}
    assert [p.keep for p in plans[2:4]] == [pytest.approx(68 / 401), 0.0]
    assert [p.name for p in plans_for(Found(2, 3, [L0], 4), 3)] == [
        "starve-e0-r1", "starve-e0-r0", "ragged-r1"]
    many = plans_for(Found(world=4, steps=1, blocks=[L0], experts=64), max_plans=8)
    assert len(many) == 8 and {p.step for p in many} == {0}
    starved = [p.starve for p in many if p.starve is not None and p.rank == 3]
    assert starved[0] == 0 and starved[-1] == 63  # spread, first and last included


def test_ragged_counts_at_the_step_and_the_sentence_a_size_mismatch_shows() -> None:
    ev = _ev({0: [RouterCall(1, L0, 0, 401, (200, 201, 200, 201), 2)],
              1: [RouterCall(1, L0, 0, 68, (34, 34, 34, 34), 2, True)]})
    report = routing_report(ev)
    assert report is not None and report.ragged[0].tokens == {0: 401, 1: 68}
    assert routing_sentence(report, [1], size=True) == (
        f"rank 1 sent 68 tokens into {L0} at step 1, by moe-hang check's plan (rank 0: 401)")
    assert routing_sentence(report, [], size=False) == routing_sentence(report, [], True)
    assert RoutingReport.from_dict(report.to_dict()) == report


def _result(name: str | None, verdict: str, culprits: list[int]) -> PlanResult:
    plan = None if name is None else next(p for p in plans_for(
        Found(2, 3, [L0, L1], 8), 10) if p.name == name)
    return PlanResult(plan, verdict, 3 if verdict == "hang" else 0,
                      "Rank 1 skipped the all-gather of the expert's FSDP unit that rank 0 "
                      "waits in at modeling_mixtral.py:133.", culprits, f"/runs/c/{name}",
                      12.0, f"rank 1 routed 0 of 32 tokens to {L1} expert 2 at step 1 "
                      "(rank 0: 9 of 32)" if verdict == "hang" else None, True)


def test_check_screen_fits_and_leads_with_the_answer() -> None:
    names = [p.name for p in plans_for(Found(2, 3, [L0, L1], 8), 10)]
    res = CheckResult(Path("/runs/c"), _result(None, "healthy", []), Found(2, 3, [L0, L1], 8),
                      [_result(n, "hang" if n == names[4] else "healthy",
                               [1] if n == names[4] else []) for n in names])
    lines = check_screen(res, 80)
    text = "\n".join(t.plain for t in lines)
    assert screen_lines(lines, 80) <= 15
    assert lines[0].plain == "moe-hang check: REPRODUCED by 1 of 10 plans (hang)"
    assert "rank 1 routed 0 of 32 tokens" in text and "next: moe-hang analyze" in text
    assert res.exit_code == 3 and res.to_dict()["reproduced"] == 1
    clean = CheckResult(Path("/runs/c"), _result(None, "healthy", []), Found(2, 3, [L0], 8),
                        [_result(n, "healthy", []) for n in names[:3]])
    assert clean.exit_code == 0
    assert isinstance(check_screen(clean, 80)[0], Text)
    assert "every plan ran clean (3 of 3)" in check_screen(clean, 80)[0].plain


def test_check_screen_of_a_compiled_model_says_so_and_what_to_run() -> None:
    """No router seen because torch.compile traced them: not "name one: --router"."""
    res = CheckResult(Path("/runs/c"), _result(None, "healthy", []), None, compiled=True)
    text = "\n".join(t.plain for t in check_screen(res, 80))
    assert text.startswith("moe-hang check: no MoE router seen outside torch.compile's "
                           "graphs")
    assert "TORCH_COMPILE_DISABLE=1" in text and "no module with `experts`" not in text
    assert res.exit_code == 0 and res.to_dict()["compiled"] is True
    plain = CheckResult(Path("/runs/c"), _result(None, "healthy", []), None)
    assert "--router" in "\n".join(t.plain for t in check_screen(plain, 80))


def test_sentences_when_every_rank_is_a_culprit() -> None:
    """repro's ragged gather: both ranks are named; nothing is left for the parentheses."""
    ev = _ev({0: [RouterCall(0, "layers.0", 0, 68, (30, 38, 40, 28), 2)],
              1: [RouterCall(0, "layers.0", 0, 401, (200, 201, 0, 401), 2)]})
    report = routing_report(ev)
    assert report is not None
    assert routing_sentence(report, [0, 1], size=True) == (
        "rank 0 and rank 1 sent 68 and 401 tokens into layers.0 at step 0")
    assert gap_sentence(report.gaps[0], [0, 1]) == (
        "rank 0 and rank 1 routed 40 of 68 and 0 of 401 tokens to layers.0 expert 2 at step 0")


@pytest.mark.parametrize("empty", [1, 0])  # mirrored
def test_a_rank_whose_tokens_reached_no_expert_gets_the_gradient_anchor(empty: int) -> None:
    """LoRA on the experts is all that trains: a rank that routed no token has a loss with no
    gradient, and backward raises there; its counts say why, and the advice follows them."""
    from moe_hang.analysis.rules import diagnose
    from moe_hang.evidence.model import RankError
    from moe_hang.evidence.stacks import Frame
    from moe_hang.evidence.vocab import JobState

    raised = RankEvidence(rank=empty, alive=False, exit_code=1, error=RankError(
        "RuntimeError", "element 0 of tensors does not require grad and does not have a "
        "grad_fn", frames=[Frame("/job/train.py", 72, "main")], time=1.0),
        routing=[RouterCall(1, L0, 0, 0, (0, 0, 0, 0), 2)])
    peer = RankEvidence(rank=1 - empty, alive=False, exit_code=1, error=RankError(
        "RuntimeError", "Connection closed by peer [127.0.0.1]:5", time=2.0),
        routing=[RouterCall(1, L0, 0, 32, (16, 16, 16, 16), 2)])
    d = diagnose(Evidence(ranks={empty: raised, 1 - empty: peer}, job=JobState.FAILED))
    assert d.verdict == Verdict.CRASH and d.culprit_ranks == [empty]
    assert d.fix.startswith(f"Rank {empty} routed no token into {L0} at step 1")
    assert "anchor_gradients" in d.fix
    # the same error without counts: no claim about routing
    raised.routing, peer.routing = [], []
    d = diagnose(Evidence(ranks={empty: raised, 1 - empty: peer}, job=JobState.FAILED))
    assert "routed" not in d.fix


def test_check_html_links_each_reproducing_run_to_its_own_report(tmp_path: Path) -> None:
    from moe_hang.report.check_html import save_check_html

    names = [p.name for p in plans_for(Found(2, 3, [L0, L1], 4), 3)]
    results = [_result(n, "hang" if n == names[0] else "healthy",
                       [1] if n == names[0] else []) for n in names]
    for r in results:
        r.run_dir = str(tmp_path / "c" / r.run_dir.rsplit("/", 1)[-1])
        Path(r.run_dir).mkdir(parents=True)
    res = CheckResult(tmp_path / "c", _result(None, "healthy", []), Found(2, 3, [L0, L1], 4),
                      results)
    d = Diagnosis(verdict=Verdict.HANG, summary="Rank 1 skipped ...", culprit_ranks=[1])
    page = tmp_path / "check.html"
    save_check_html(res, {names[0]: d}, page)
    html = page.read_text()
    assert "REPRODUCED by 1 of 3 plans" in html and "<script" not in html
    assert f'href="c/{names[0]}/report.html"' in html  # relative, to its own page
    assert (Path(results[0].run_dir) / "report.html").exists()
    assert not (Path(results[1].run_dir) / "report.html").exists()  # clean runs: the dir


def _compared(failures: list[str] | None = None, error: str | None = None) -> ReferenceReport:
    return ReferenceReport(ok=not failures and error is None, max_rel_err=3e-7, compared=66,
                           failures=failures or [], steps=3, error=error)


def test_check_screen_says_what_the_reference_proved() -> None:
    names = [p.name for p in plans_for(Found(2, 3, [L0, L1], 8), 10)][:3]

    def res(refs: list[ReferenceReport]) -> CheckResult:
        runs = [_result(None, "healthy", []), *(_result(n, "healthy", []) for n in names)]
        for r, ref in zip(runs, refs, strict=True):
            r.reference = ref
        return CheckResult(Path("/runs/c"), runs[0], Found(2, 3, [L0], 8), runs[1:],
                           compared=True)

    same = res([_compared()] * 4)
    text = "\n".join(t.plain for t in check_screen(same, 80))
    assert "every plan ran clean (3 of 3) and matches the single-process reference (max " \
           "rel err 3.0e-07)" in " ".join(text.split())
    assert "reference=" not in text and same.exit_code == 0  # nothing left untried there
    bad = res([_compared(), _compared(["step 1 rank 1 output: max abs err 0.005 > tolerance "
                                       "4e-08"]), _compared(), _compared()])
    lines = check_screen(bad, 80)
    text = " ".join("\n".join(t.plain for t in lines).split())
    assert lines[0].plain == "moe-hang check: DIFFERS from the single-process reference in 1 " \
                             "of 4 runs"
    assert f"{names[0]}: every step finished, not as the single-process reference did: step " \
           "1 rank 1 output" in text
    assert f"details in /runs/c/{names[0]}/reference.json" in text
    assert bad.exit_code == 4 and bad.to_dict()["differs"] == 1
    odd = res([_compared(), _compared(), _compared(),
               _compared(error="on rank 1's batch at step 1: IndexError: index 0")])
    text = " ".join("\n".join(t.plain for t in check_screen(odd, 80)).split())
    assert "3 of 4 runs match the single-process reference" in text
    assert "1 could not be compared" in text and "(not compared)" in text
    assert f"{names[2]}: not compared, the single-process reference itself failed on rank 1's" \
           in text
    assert odd.exit_code == 0 and not odd.differs and odd.to_dict()["uncompared"] == 1
    assert all(screen_lines(check_screen(r, 80), 80) <= 15 for r in (same, bad, odd))


def test_without_a_reference_the_screen_says_the_outputs_were_not_compared() -> None:
    clean = CheckResult(Path("/runs/c"), _result(None, "healthy", []), Found(2, 3, [L0], 8),
                        [_result("starve-e0-r1", "healthy", [])])
    text = " ".join("\n".join(t.plain for t in check_screen(clean, 80)).split())
    assert "not tried: " in text and "single-process reference (moe_hang.check(..., " \
           "reference=build_reference))" in text


def test_the_comparison_is_normwise_and_a_missing_gradient_is_zero() -> None:
    import torch

    from moe_hang.usercheck.compare import Comparison

    c = Comparison(rtol=1e-5)
    c.check("a", torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.0 + 1e-6]))
    c.check("none", None, torch.zeros(3))  # no token reached it: a zero gradient
    c.check("both", None, None)
    assert c.report(1, "x")["ok"] and c.compared == 3
    c.check("b", torch.tensor([1.0]), torch.tensor([1.1]))
    c.check("shape", torch.zeros(2), torch.zeros(3))
    r = c.report(1, "x")
    assert not r["ok"] and r["worst"] == "b" and len(r["failures"]) == 2
    assert r["failures"][1] == "shape: shape [2] != [3]"


def test_the_default_tolerance_is_the_least_precise_dtypes() -> None:
    import torch

    from moe_hang.usercheck.compare import rtol_for
    from moe_hang.usercheck.reference import compare_run

    assert rtol_for({"torch.float32"}) == 1e-5 and rtol_for(set()) == 1e-5
    assert rtol_for({"torch.float32", "torch.bfloat16"}) == 2e-2
    assert rtol_for({"float16", "torch.int64"}) == 5e-3
    # a bfloat16 model's ranks and its reference differ in the last bits: no mismatch there,
    # unless the caller asks for float32's tolerance
    want = torch.tensor([1.0, 2.0, 3.0])
    ref = [{"outs": [want], "losses": [1.0], "grads": {}, "dtypes": ["torch.bfloat16"]}]
    got = {0: {"steps": [{"out": want * 1.004, "loss": 1.0, "grads": {}}],
               "dtypes": ["torch.bfloat16"]}}
    loose = compare_run(ref, got, 1, None)
    assert loose["ok"] and loose["rtol"] == 2e-2
    strict = compare_run(ref, got, 1, 1e-5)
    assert not strict["ok"] and strict["failures"][0].startswith("step 0 rank 0 output")
