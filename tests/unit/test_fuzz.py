"""The fault generator (moe_hang.testing.fuzz), without running a job: draws are deterministic
for a seed, every fault kind, family, launch and mode is reachable, rendered jobs are valid
Python that imports only torch, every line the truth names is a marker that exists once, the
mirrored twin swaps the roles, the simulator's gloo model, and the truth in the corpus' own
terms (a ``Case`` that the corpus harness scores, and its source)."""

from __future__ import annotations

import ast
import json
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

from moe_hang.probe.env import ENV_FR_STACKS
from moe_hang.testing.fuzz import catalogue, families, truth
from moe_hang.testing.fuzz.corpus import CORPUS, case_source, describe, role_envs, to_case
from moe_hang.testing.fuzz.draw import draw, neighbour_of, stackless_of, stacks_single_out
from moe_hang.testing.fuzz.events import P2P, Coll, Stop
from moe_hang.testing.fuzz.plant import Plant, programs
from moe_hang.testing.fuzz.runner import SPEC_DEFAULTS, job_source
from moe_hang.testing.fuzz.simulate import simulate

if str(CORPUS) not in sys.path:
    sys.path.insert(0, str(CORPUS))

import cases
import harness

SEED = 20261201
DRAWS = [draw(SEED, i) for i in range(240)]


def test_a_seed_draws_the_same_jobs() -> None:
    for i in (0, 7, 101):
        a, b = draw(SEED, i), draw(SEED, i)
        assert a[0] == b[0]
        assert job_source(a[0]) == job_source(b[0])
    assert [s.kind for s, _ in DRAWS[:20]] != [s.kind for s, _ in
                                             (draw(SEED + 1, i) for i in range(20))]


def test_a_seed_draws_the_same_layout_and_neighbour() -> None:
    again = [draw(SEED, i)[0] for i in range(0, 240, 7)]
    assert [(s.shape, s.neighbour, s.plant) for s in again] == \
        [(DRAWS[i][0].shape, DRAWS[i][0].neighbour, DRAWS[i][0].plant) for i in range(0, 240, 7)]


def test_every_kind_has_its_share_of_200_runs() -> None:
    """N=200 runs (a twin is a run): every kind, old and new, about 10 (each block of
    len(KINDS) jobs draws every kind once), none under 8."""
    runs: dict[str, int] = {}
    n = 0
    for spec, t in DRAWS:
        k = min(len(t.roles()), 200 - n)
        runs[spec.kind] = runs.get(spec.kind, 0) + k
        n += k
        if n >= 200:
            break
    assert set(runs) == {k.name for k in catalogue.KINDS}
    assert min(runs.values()) >= 8, runs


def test_the_new_kinds_and_their_variants_are_drawn() -> None:
    variants = {(s.kind, s.plant.variant, s.shape) for s, _ in DRAWS}
    for kind in ("silent", "step_shift", "async", "thread"):
        assert {v for k, v, _ in variants if k == kind} == {"skip", "extra"}, kind
    assert {v for k, v, _ in variants if k == "fsdp_eval"} == {"eval", "checkpoint"}
    assert {sh for k, _, sh in variants if k in ("silent", "step_shift")} == {"loss", "ntok"}
    assert {(k, sh) for k, _, sh in variants if k in ("async", "thread")} == \
        {("async", "async"), ("thread", "thread")}
    fams = {(s.kind, s.family) for s, _ in DRAWS}
    assert {f for k, f in fams if k == "fsdp_eval"} == {"fsdp2", "fsdp2_moe"}
    assert len({f for k, f in fams if k == "step_shift"}) >= 5


def test_a_third_of_the_jobs_run_beside_a_busy_neighbour() -> None:
    """One job in every three (at least a quarter of any N), on every seed."""
    for seed in (SEED, 1, 27):
        flags = [neighbour_of(seed, i) for i in range(300)]
        assert sum(flags) == 100
        assert all(sum(flags[i:i + 3]) == 1 for i in range(0, 300, 3))
    specs = [s for s, _ in DRAWS]
    assert sum(s.neighbour for s in specs) >= len(specs) // 4
    assert {s.neighbour for s in specs if s.mode == "diagnose"} == {True, False}


def test_a_quarter_of_the_watched_jobs_record_no_call_stacks() -> None:
    """One job in every four, from a stream of its own; watched runs only (``diagnose``
    starts no recorder). Both roles' environments say so; a report written before the
    field existed is still the same job."""
    flags = [stackless_of(SEED, i) for i in range(400)]
    assert sum(flags) == 100 and all(sum(flags[i:i + 4]) == 1 for i in range(0, 400, 4))
    specs = [(s, t) for s, t in DRAWS]
    assert not any(s.stackless for s, _ in specs if s.mode == "diagnose")
    stackless = [(s, t) for s, t in specs if s.stackless]
    assert len(stackless) >= len([s for s, _ in specs if s.mode == "watch"]) // 5
    s, t = stackless[0]
    assert all(env[ENV_FR_STACKS] == "0" for env in role_envs(s, t))
    assert "no call stacks in the recorder" in describe(s)
    plain = next((s, t) for s, t in specs if not s.stackless)
    assert all(ENV_FR_STACKS not in env for env in role_envs(*plain))
    saved = json.loads(json.dumps(asdict(plain[0])))
    del saved["stackless"]
    assert {**SPEC_DEFAULTS, **saved} == json.loads(json.dumps(asdict(plain[0])))


def test_the_new_kinds_run_under_diagnose_only_where_stacks_show_the_line() -> None:
    """A rank in work.wait() shows the wait, not the line its collective was posted from;
    a shift of gloo's pairing puts ranks at lines program order says nothing of (a majority
    decides: 3 ranks or more); the FSDP backward a rank-only eval breaks in aborts."""
    for spec, t in DRAWS:
        if spec.mode != "diagnose":
            continue
        assert not any(rt.outcome.hidden for rt in t.roles()), spec.name
        assert spec.kind != "fsdp_eval", spec.name
        if spec.kind in truth.SHIFTED:
            assert spec.world >= 3 and all(stacks_single_out(rt) for rt in t.roles())
    assert any(s.kind == "async" and s.mode == "watch" and t.primary.outcome.hidden
               for s, t in DRAWS)


def test_every_kind_family_launch_and_mode_is_reachable() -> None:
    specs = [s for s, _ in DRAWS]
    assert {s.kind for s in specs} == {k.name for k in catalogue.KINDS}
    assert {s.family for s in specs} == set(families.FAMILIES)
    assert {s.launch for s in specs} == {"torchrun", "two_nodes"}
    assert {s.mode for s in specs} == {"watch", "diagnose"}
    assert {s.world for s in specs} == {2, 3, 4, 6, 8}
    variants = {(s.kind, s.plant.variant) for s in specs}
    assert {("skip", "wrap"), ("skip", "continue"), ("skip", "module")} <= variants
    # the two-node culprit lands on either half of the ranks (either node: a fixed layout
    # only up to torch's rendezvous race)
    halves = {s.culprits[0] < s.world // 2 for s in specs if s.launch == "two_nodes"}
    assert halves == {True, False}


@pytest.mark.parametrize("index", range(0, 240, 3))
def test_rendered_job_is_plain_valid_python(index: int) -> None:
    spec, _ = DRAWS[index]
    src = job_source(spec)
    tree = ast.parse(src)
    compile(tree, spec.name, "exec")
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import)
                for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree)
                 if isinstance(n, ast.ImportFrom) and n.module}
    assert imported <= {"datetime", "os", "sys", "signal", "threading", "queue", "time", "pathlib",
                        "torch"}, imported
    assert "moe_hang" not in src
    assert all(len(line) <= 100 for line in src.splitlines())  # ruff's limit in tests/


@pytest.mark.parametrize("index", range(0, 240, 2))
def test_truth_names_markers_that_exist_once(index: int, tmp_path: Path) -> None:
    spec, t = DRAWS[index]
    job = tmp_path / f"{spec.name}.py"
    job.write_text(job_source(spec))
    found = harness.markers(job)  # raises on a marker written twice
    for lt in t.lines:
        assert lt.marker in found, (lt, sorted(found))
    if not catalogue.kind(spec.kind).healthy:
        assert t.lines, spec.name  # a problem case is always checked on lines
        assert t.fix_forbid or t.fix_require
    case = to_case(spec, t, job)
    for env, _mirrored in harness.runs_of(case, True):
        exp = harness.expected_for(case, env)
        assert all(0 <= r < spec.world for r in exp.culprits)
        for ex in exp.lines:
            harness.resolve_site(ex.site, job)


def test_the_mirrored_twin_swaps_the_roles() -> None:
    twins = 0
    for spec, t in DRAWS:
        envs = t.envs()
        if len(envs) == 1:
            assert spec.mirror == ()
            continue
        twins += 1
        a, b = envs
        assert a["CULPRIT_RANKS"] != b["CULPRIT_RANKS"]
        assert set(a) == set(b)  # every role variable is set in both
        if t.lines:
            assert a != b
    assert twins > 200


def test_healthy_kinds_expect_no_advice_and_exit_0() -> None:
    for spec, t in DRAWS:
        if catalogue.kind(spec.kind).healthy:
            assert t.verdicts == truth.HEALTHY and t.fix_none and not t.lines
            assert "post the collective" in t.fix_forbid


def test_verdict_sets_are_the_corpus_ones() -> None:
    assert truth.HEALTHY == cases.HEALTHY and truth.STALLED == cases.STALLED
    assert truth.DESYNC == cases.DESYNC and truth.DESYNC_OR_HANG == cases.DESYNC_OR_HANG


def test_case_source_is_the_same_case() -> None:
    """The miss's Case(...) source, evaluated in cases.py, is the case the run was scored on."""
    for spec, t in DRAWS[:60]:
        job = Path(f"/tmp/{spec.name}.py")
        made = to_case(spec, t, job)
        src = case_source(spec, t, job.name)
        again = eval(src.rstrip().rstrip(","), vars(cases))
        for f in ("name", "nproc", "verdicts", "mode", "env", "mirror", "fix_forbid",
                  "fix_require", "fix_none", "summary_contains", "basis", "certainty",
                  "stall", "watch_opts", "timeout_s", "nnodes"):
            assert getattr(again, f) == getattr(made, f), (spec.name, f)
        for env, _ in harness.runs_of(made, True):
            assert harness.expected_for(again, env).culprits == \
                harness.expected_for(made, env).culprits
            assert [(x.site, x.where, x.ranks(env)) for x in again.lines] == \
                [(x.site, x.where, x.ranks(env)) for x in made.lines]


# --- the simulator: gloo's semantics as measured ----------------------------------------------

def _members(group: str, rank: int) -> tuple[int, ...]:
    return (0, 1) if group in ("world", "log") else (rank,)


def test_simulator_matching_collectives_complete() -> None:
    prog = [Coll("world", "all_reduce", "f32x4", "a"), Coll("world", "barrier", "barrier", "f")]
    assert simulate([prog, prog], _members).state == "finished"


def test_simulator_different_ops_wait_for_ever() -> None:
    out = simulate([[Coll("world", "all_reduce", "f32x4", "a")],
                    [Coll("world", "broadcast", "f32x4", "b")]], _members)
    assert out.state == "hang" and out.at == {0: "a", 1: "b"}


def test_simulator_same_op_different_bytes_aborts() -> None:
    out = simulate([[Coll("world", "all_reduce", "f32x4", "a")],
                    [Coll("world", "all_reduce", "f32x6", "a")]], _members)
    assert out.state == "abort" and out.abort == {0: "a", 1: "a"}


def test_simulator_a_send_waits_for_its_recv() -> None:
    out = simulate([[P2P("send", 1, "act", "send"), Coll("world", "barrier", "barrier", "f")],
                    [Stop("raise", "raise")]], _members)
    assert out.state == "hang" and out.at == {0: "send", 1: "raise"}


def test_an_order_swap_over_disjoint_groups_can_complete() -> None:
    """A 2x2 mesh where one rank reduces tp before dp: its partners are free to finish
    theirs first, so nothing hangs (the draw does not keep such a plant)."""
    fam = families.build("mesh2d", 4, (2, 2))
    swapped = Plant("order_swap", "tp_reduce", 2, 4)
    progs = programs(fam, swapped, frozenset({0}))
    for r in range(4):  # tp_reduce and dp_reduce swapped on rank 0 only
        progs[r] = [e for e in progs[r] if not (isinstance(e, Coll) and e.marker in
                                                ("stats", "metrics", "stop"))]
    assert simulate(progs, fam.members).state == "finished"


def test_a_skipped_expert_is_found_where_the_shift_starts() -> None:
    fam = families.build("fsdp2_moe", 2)
    plant = Plant("skip", "forward", 2, 4, "module", 1)
    t = truth.truth(fam, plant, catalogue.kind("skip"), frozenset({1}), frozenset({0}))
    assert {(lt.marker, lt.where) for lt in t.lines} == {("expert", "divergence"),
                                                        ("expert", "divergence?")}
    assert t.fix_require == ("expert",) and "every expert" not in t.fix_forbid
    last = truth.truth(fam, Plant("skip", "forward", 2, 4, "module", families.EXPERTS - 1),
                       catalogue.kind("skip"), frozenset({1}), frozenset({0}))
    assert {(lt.marker, lt.where) for lt in last.lines} == {("expert", "divergence"),
                                                           ("head", "divergence?")}


def test_a_pipeline_stage_that_skips_its_send() -> None:
    fam = families.build("p2p", 4)
    t = truth.truth(fam, Plant("recv_no_send", "send", 2, 4), catalogue.kind("recv_no_send"),
                    frozenset({1}), frozenset({2}))
    env = t.envs()[0]
    assert env["FUZZ_AT_RECV"] == "2,3" and env["FUZZ_AT_STATS"] == "0,1"
    assert t.fix_require == ("send",) and t.verdicts == truth.DESYNC_OR_HANG


def test_a_broadcast_receiver_leaves_once_the_root_posted() -> None:
    """Measured: rank 0 broadcasts, rank 1 posts an all_reduce there instead, rank 2 (a
    receiver) gets the root's data and goes on to the next collective."""
    three = lambda group, rank: (0, 1, 2)  # noqa: E731
    bc = Coll("world", "broadcast", "f32x1", "stop")
    nxt = Coll("world", "all_gather", "proj", "gather")
    out = simulate([[bc, nxt], [Coll("world", "all_reduce", "f32x1", "swapped"), nxt],
                    [bc, nxt]], three)
    assert out.state == "hang" and out.at == {0: "stop", 1: "swapped", 2: "gather"}


def test_gloo_broadcast_tree() -> None:
    """gloo/broadcast.cc: 0 -> 1 in round 0; 0 -> 2 and 1 -> 3 in round 1; 0 -> 4, 1 -> 5..."""
    from moe_hang.testing.fuzz.gloo import tree as _tree

    assert _tree(0, 4) == (None, [1, 2])
    assert _tree(1, 4) == (0, [3]) and _tree(3, 4) == (1, [])
    assert _tree(0, 3) == (None, [1, 2]) and _tree(1, 3) == (0, [])
    assert _tree(0, 8) == (None, [1, 2, 4]) and _tree(3, 8) == (1, [7])
    assert _tree(0, 2) == (None, [1])


def test_a_broadcast_forwarder_waits_for_its_child() -> None:
    """Measured (4 ranks): rank 3 raised before the broadcast; rank 1, which forwards to 3,
    stays in it; ranks 0 and 2 leave it."""
    four = lambda group, rank: (0, 1, 2, 3)  # noqa: E731
    bc = Coll("world", "broadcast", "f32x1", "stop")
    nxt = Coll("world", "all_gather", "inp", "inp")
    out = simulate([[bc, nxt], [bc, nxt], [bc, nxt], [Stop("raise", "raise")]], four)
    assert out.at == {0: "inp", 1: "stop", 2: "inp", 3: "raise"}


def test_diagnose_is_drawn_only_where_stacks_can_tell() -> None:
    """A rank that skips a broadcast others could leave (gloo's tree) is told apart by the
    recorder's sequence numbers only: such jobs run under watch."""
    for spec, t in DRAWS:
        if spec.mode == "diagnose" and not catalogue.kind(spec.kind).healthy:
            assert all(rt.outcome.state == "hang" and not rt.outcome.partial
                       for rt in t.roles()), spec.name
            assert spec.kind not in ("op_swap", "order_swap", "extra") or spec.world >= 3
            assert spec.kind != "wrong_group" or len(spec.culprits) > 1
            assert spec.kind == "recv_no_send" or all(
                stacks_single_out(rt) for rt in t.roles()), spec.name
    fam = families.build("plain", 4)
    skip = truth.role_truth(fam, Plant("skip", "stop", 2, 4, "wrap"), catalogue.kind("skip"),
                            frozenset({2}))
    assert skip.outcome.partial and skip.env["FUZZ_AT_STOP"] == "0"


def test_the_table_counts_runs_by_kind_and_the_last_line_is_the_accuracy() -> None:
    from types import SimpleNamespace

    from moe_hang.testing.fuzz import report
    from moe_hang.testing.fuzz.runner import Run

    def run(i: int, ok: bool, mirrored: bool) -> Run:
        spec, t = DRAWS[i]
        checks = dict.fromkeys(harness.FIELDS, "n/a")
        checks.update(run="ok", verdict="ok", exit="ok", culprit="ok" if ok else "[0]≠[1]",
                      lines="ok", advice="ok")
        score = SimpleNamespace(ok=ok, checks=checks, got={}, env={}, outcome=None)
        return Run(spec, t, mirrored, Path("/tmp/x.py"), "Case()", score, 1.0)

    runs = [run(0, True, False), run(0, False, True), run(1, True, False)]
    assert report.accuracy_line(runs) == "accuracy: 2/3 runs fully right"
    text = report.table(runs)
    assert "a mirrored twin is a run of its own" in text
    kind = DRAWS[0][0].kind
    row = next(line for line in text.splitlines() if line.startswith(kind))
    assert row.split()[1] == ("3" if DRAWS[1][0].kind == kind else "2")
    assert report.markdown(runs).splitlines()[-1].startswith("| **all** | 3 | **2/3 (67 %)**")


def test_a_broadcast_against_an_extra_all_reduce() -> None:
    """Measured (4 ranks, a pipeline): rank 3 posts an extra all_reduce where the others
    broadcast; rank 1 (which forwards to 3) stays in the broadcast, ranks 0 and 2 leave it
    and wait in the next step's send and recv."""
    fam = families.build("p2p", 4)
    t = truth.role_truth(fam, Plant("extra", "metrics", 3, 5, "eval"), catalogue.kind("extra"),
                         frozenset({3}))
    assert t.outcome.at == {0: "send", 1: "stop", 2: "recv", 3: "extra"}


def test_a_wrong_group_fix_names_the_group_only_where_the_group_is_seen() -> None:
    for spec, t in DRAWS:
        if spec.kind == "wrong_group":
            assert ("group" in t.fix_require) == (spec.mode == "watch"), spec.name


def test_a_mesh_skip_whose_culprit_shares_its_line_runs_under_watch() -> None:
    """A 2-D mesh where the skipper went past its tp all-reduce to the line where ranks that
    skipped nothing are (once drawn under diagnose: seed 20261202 job 18, 5550123 job 3, where
    the stacks named every rank past it): only the recorder's groups tell them apart."""
    found = 0
    for seed in (20261202, 5550123):
        for i in range(300):
            spec, t = draw(seed, i)
            if (spec.kind, spec.family) == ("skip", "mesh2d") and \
                    not all(stacks_single_out(rt) for rt in t.roles()):
                found += 1
                assert spec.mode == "watch", spec.name
    assert found


def test_the_false_alarm_jobs_cover_every_family_and_layout_healthily() -> None:
    from moe_hang.testing.fuzz.alarms import healthy_jobs, table

    jobs = healthy_jobs(SEED, 12.0, None)
    assert {s.family for s, _ in jobs} == set(families.FAMILIES)
    assert {s.shape for s, _ in jobs} == {"plain", "loss", "ntok", "async", "thread"}
    assert len({(s.family, s.shape) for s, _ in jobs}) == len(jobs)  # one job each
    for spec, t in jobs:
        assert spec.kind == "busy" and spec.mode == "diagnose" and spec.plant.seconds == 12.0
        assert t.verdicts == truth.HEALTHY and all(rt.outcome.state == "finished"
                                                   for rt in t.roles())
        ast.parse(job_source(spec))
    assert sum(s.neighbour for s, _ in jobs) == (len(jobs) + 2) // 3
    assert [s.name for s, _ in healthy_jobs(SEED, 12.0, None)] == [s.name for s, _ in jobs]
    assert {s.family for s, _ in healthy_jobs(SEED, 3.0, {"p2p"})} == {"p2p"}
    assert table([]).startswith("family")


def test_a_skip_gloo_aborts_on_requires_the_line_skipped_not_the_culprits_next() -> None:
    """Fresh seed 71529384, job 82 (both roles): a rank skips its gradient all-reduce, its
    stats all-reduce meets the others' gradients and gloo aborts it. What shows the fault is
    the others' line, the collective it skipped; its own next one is incidental (as for the
    kinds gloo pairs silently) — the tool shows the skipper as never posting it. Was: the
    skipper's stats line required at the divergence, the others' optional."""
    fam = families.build("plain", 4)
    for culprit in (0, 3):
        t = truth.role_truth(fam, Plant("skip", "grads", 3, 5, "wrap"),
                             catalogue.kind("skip"), frozenset({culprit}))
        assert t.outcome.state == "abort" and culprit in t.outcome.killed
        where = {(x.marker, x.where) for x in t.lines}
        assert where == {("grads", "divergence"), ("stats", "divergence?")}, where
        assert t.env["FUZZ_DIV_GRADS"] == ",".join(str(r) for r in range(4) if r != culprit)
