"""scripts/fr_synth.py writes dumps shaped like torch's, and `analyze` names every planted
fault kind on them (small sets here; scripts/bench_postmortem.py runs the big ones)."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
from conftest import FIXTURES, fr_synth, make_fr_set

from moe_hang.commands.diagnose import analyze_paths

REAL = FIXTURES / "fr_real"


def make_set(out: Path, *args: str) -> dict:
    return make_fr_set(out, *args)


def test_one_dump_per_rank_named_by_torch_and_a_truth_file(tmp_path):
    truth = make_set(tmp_path, "--ranks", "8", "--mesh", "2x4", "--entries", "25",
                     "--fault", "dtype")
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == sorted([f"comm_lib_trace_rank_{r}" for r in range(8)] + ["truth.json"])
    d = pickle.loads((tmp_path / "comm_lib_trace_rank_0").read_bytes())
    assert list(d) == ["version", "pg_config", "comm_lib_version", "pg_status", "entries"]
    assert len(d["entries"]) == 25 and d["entries"][0]["record_id"] > 0  # the buffer wrapped
    assert truth["fault"] == "dtype" and len(truth["culprits"]) == 1


@pytest.mark.parametrize("form,args", [("pickle", []), ("json", ["--format", "json"])])
def test_synthetic_gloo_dumps_have_the_real_ones_shape(tmp_path, form, args):
    make_set(tmp_path, "--ranks", "4", "--mesh", "2x2", "--entries", "16", "--backend", "gloo",
             *args)
    assert fr_synth().check_against(REAL / "world2_skip" / form, tmp_path) == 0


CASES = [(b, f) for b in ("nccl", "gloo") for f in ("missing_rank", "size", "dtype", "op",
                                                   "order", "p2p", "none")]


def _case(backend: str, fault: str):
    return pytest.param(backend, fault, id=f"{backend}-{fault}")


def _expected(truth: dict) -> tuple[list[int], set, set]:
    """The culprits, groups and sequence numbers a right post-mortem answer may name."""
    culprits = truth.get("culprits", [])
    if truth["fault"] == "p2p" and truth["backend"] == "gloo":
        culprits = truth["victims"]  # gloo recorded no send: the stuck recv's rank is all
    groups = {(truth.get("group") or {}).get("name")}
    seqs = {truth.get("seq")}
    if "second_group" in truth:  # an order fault is a cycle through two groups
        groups.add(truth["second_group"]["name"])
        seqs.add(truth["second_group"]["seq"])
    return culprits, groups, seqs


@pytest.mark.parametrize("backend,fault", [_case(b, f) for b, f in CASES])
def test_every_planted_fault_is_named(tmp_path, backend, fault):
    truth = make_set(tmp_path, "--ranks", "16", "--mesh", "4x4", "--entries", "60",
                     "--fault", fault, "--backend", backend)
    d = analyze_paths([tmp_path], force=False)
    culprits, groups, seqs = _expected(truth)
    assert d.culprit_ranks == culprits, d.summary
    if fault == "none":
        assert d.first_divergence is None
        return
    fd = d.first_divergence
    assert fd is not None, d.summary
    if fault == "p2p" and backend == "gloo":
        # no send/recv in gloo's dumps: the collective the others wait in, without the victim
        assert fd.kind == "missing_rank" and fd.per_rank.get(culprits[0]) is None, d.summary
        return
    assert fd.pg in groups and fd.seq in seqs, d.summary


def test_gloo_skip_across_groups_when_creation_times_tie(tmp_path):
    """The culprit skipped its dp collective and waits in the next world all-reduce, where
    its dp peers are absent: two divergences whose creation times tie within the jitter; the
    order the ranks posted in (record ids) says who went past what."""
    truth = make_set(tmp_path, "--ranks", "8", "--mesh", "2x4", "--entries", "30",
                     "--fault", "missing_rank", "--backend", "gloo")
    d = analyze_paths([tmp_path], force=False)
    assert d.culprit_ranks == truth["culprits"], d.summary


# Every planted culprit, whichever rank the seed picks (the culprit moves with it: a rule that
# picked by rank number or dict order would fail some of these), on meshes whose groups have
# two members (no majority: the evidence must come from order or history) and four.
SWEEP = [(b, f, mesh, seed) for b in ("nccl", "gloo") for f in ("order", "p2p", "size", "dtype")
         for mesh in ("2x2", "4x4") for seed in (1, 2, 3)]


@pytest.mark.parametrize("backend,fault,mesh,seed", SWEEP)
def test_the_culprit_moves_with_the_planted_fault(tmp_path, backend, fault, mesh, seed):
    dp, tp = map(int, mesh.split("x"))
    n = dp * tp
    truth = make_set(tmp_path, "--ranks", str(n), "--mesh", mesh, "--entries", "60",
                     "--fault", fault, "--backend", backend, "--seed", str(seed))
    d = analyze_paths([tmp_path], force=False)
    assert d.culprit_ranks == _expected(truth)[0], d.summary


def test_the_sweep_plants_different_culprits():
    """The sweep above is only a mirror test if the seeds move the culprit."""
    import tempfile
    seen = set()
    for seed in (1, 2, 3):
        with tempfile.TemporaryDirectory() as t:
            seen.add(tuple(make_set(Path(t), "--ranks", "16", "--mesh", "4x4", "--fault", "order",
                                    "--seed", str(seed))["culprits"]))
    assert len(seen) == 3


def test_nccl_skipped_send_names_the_sender_and_what_it_did_instead(tmp_path):
    truth = make_set(tmp_path, "--ranks", "8", "--mesh", "2x4", "--entries", "60",
                     "--fault", "p2p", "--backend", "nccl")
    d = analyze_paths([tmp_path], force=False)
    (c,), (v,) = truth["culprits"], truth["victims"]
    assert d.rule == "unmatched send/recv" and d.certainty == "likely"
    assert d.summary.startswith(f"Rank {c} never posted the send that rank {v}'s recv"), d.summary
    assert "went on to" in d.summary and f"send(dst={v}) on rank {c}" in d.fix


def test_nccl_order_inversion_is_likely_not_definite(tmp_path):
    """Both collectives enqueued on every rank: the posting order explains the hang, but on
    two streams another cause could too: likely, not definite."""
    truth = make_set(tmp_path, "--ranks", "16", "--mesh", "4x4", "--entries", "60",
                     "--fault", "order", "--backend", "nccl")
    d = analyze_paths([tmp_path], force=False)
    assert d.culprit_ranks == truth["culprits"] and d.certainty == "likely"
    assert "posted them the other way round (as every rank did in earlier steps)" in d.summary
    assert d.culprit_basis == "history" and "same order on every rank" in d.fix


@pytest.mark.parametrize("backend", ["nccl", "gloo"])
def test_dumps_with_nothing_pending_say_so(tmp_path, backend):
    make_set(tmp_path, "--ranks", "8", "--mesh", "2x4", "--fault", "none", "--backend", backend)
    d = analyze_paths([tmp_path], force=False)
    assert d.verdict == "inconclusive" and d.culprit_ranks == []
    done = "finished (completed, or failed: gloo retires both alike)" if backend == "gloo" \
        else "completed"
    assert d.summary.startswith(f"Every collective in the 8 dumps {done}:"), d.summary
    assert ("the dumps cannot say" in d.summary) == (backend == "gloo"), d.summary
    assert "could be read" not in d.summary and "stack" in d.fix
