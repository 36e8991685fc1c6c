"""The fault generator's model of how gloo pairs collectives (moe_hang.testing.fuzz: gloo.py,
simulate.py) and the truth it gives the kinds gloo pairs silently (issue 27): the k-th
collective of a group by op and bytes, whichever line or thread posted it; gloo's ring
all-reduce as measured on torch 2.13 CPU; async posts waited later; a metrics thread on a
group of its own. Pure and fast: no job runs here."""

from __future__ import annotations

import os
import time

import psutil
import pytest

from moe_hang.testing.fuzz import catalogue, families, truth
from moe_hang.testing.fuzz.events import Coll, Fork, Join, Wait
from moe_hang.testing.fuzz.gloo import ring
from moe_hang.testing.fuzz.neighbour import busy_neighbour
from moe_hang.testing.fuzz.plant import Plant, programs
from moe_hang.testing.fuzz.simulate import simulate
from moe_hang.testing.fuzz.truth import visible_at


def _two(group: str, rank: int) -> tuple[int, ...]:
    return (0, 1)


def _four(group: str, rank: int) -> tuple[int, ...]:
    return (0, 1, 2, 3)


def ar(n: int, marker: str, nowait: bool = False) -> Coll:
    return Coll("world", "all_reduce", f"f32x{n}", marker, nowait=nowait)


FIN = Coll("world", "barrier", "barrier", "finish")

# --- gloo's ring all-reduce with other sizes, as measured (2-4 ranks, float32) -------------

# sizes per group rank -> aborts?, the ranks that complete it (measured: which printed
# "completed"; an abort kills them all, so only whether it aborted is compared there)
MEASURED = {(1, 4): (False, {0}), (4, 1): (False, {1}), (4, 6): (True, None),
            (1, 161): (True, None), (4, 3): (False, {1}), (1, 1, 161): (True, None),
            (161, 1, 1): (True, None), (4, 4, 6): (False, {0, 1}), (6, 4, 4): (False, {1, 2}),
            (1, 4, 1): (False, {0, 2}), (4, 4, 4, 6): (False, {0, 1, 2}),
            (1, 1, 1, 161): (True, None), (4, 6, 4, 4): (False, {0, 2, 3}),
            (4, 1, 4, 4): (False, {1}), (4, 4, 3, 4): (False, {0, 2}),
            (4, 4, 4, 1): (False, {3})}


@pytest.mark.parametrize("sizes", sorted(MEASURED))
def test_gloo_ring_all_reduce_as_measured(sizes: tuple[int, ...]) -> None:
    """Equal ring segments (1 vs 4 floats: 4 bytes each) never abort: some ranks complete
    and go on, the others wait; a longer segment arriving aborts (1 vs 161: "164 vs 4")."""
    aborts, done = ring([(4, n) for n in sizes])
    want_abort, want_done = MEASURED[sizes]
    assert bool(aborts) == want_abort
    if want_done is not None:
        assert set(done) == want_done
    if sizes == (1, 161):
        assert aborts == {0}  # the 1-float rank receives 164 bytes into 4


def test_a_size_job_on_four_ranks_hangs_where_gloo_lets_three_through() -> None:
    """The old `size` kind (4 vs 6 floats) aborts on 2 ranks only: on 4 the three 4-float
    ranks complete the all-reduce and wait in the logger's all-gather."""
    fam = families.build("plain", 4)
    out = simulate(programs(fam, Plant("size", "stats", 2, 4), frozenset({3})), fam.members)
    assert out.state == "hang" and out.at == {0: "metrics", 1: "metrics", 2: "metrics",
                                              3: "stats"}
    fam2 = families.build("plain", 2)
    assert simulate(programs(fam2, Plant("size", "stats", 2, 4), frozenset({1})),
                    fam2.members).state == "abort"


# --- silent pairing ----------------------------------------------------------------------

def test_a_skip_among_equal_collectives_pairs_silently_then_aborts_on_bytes() -> None:
    """Rank 1 skips the accuracy all-reduce: its loss all-reduce pairs with rank 0's
    accuracy (same op, same bytes: nothing shows), then its next step's gradient all-reduce
    (161 floats) meets rank 0's loss (1 float): gloo aborts there."""
    step = [ar(161, "grads"), ar(1, "acc"), ar(1, "loss")]
    skipped = [ar(161, "grads"), ar(1, "loss")]
    out = simulate([step + step + [FIN], skipped + step + [FIN]], _two)
    assert out.state == "abort"
    assert out.abort == {0: "loss", 1: "grads"}
    assert out.sure == {0, 1}  # both blocked in it: rank 0 aborts, rank 1 loses its peer
    assert out.posted == {0: {"world": 3}, 1: {"world": 3}}


def test_a_skip_among_equal_collectives_hangs_on_another_op() -> None:
    ag = Coll("world", "all_gather", "inp", "inp")
    step = [ag, ar(1, "acc"), ar(1, "loss")]
    skipped = [ag, ar(1, "loss")]
    out = simulate([step + step + [FIN], skipped + step + [FIN]], _two)
    assert out.state == "hang" and out.at == {0: "loss", 1: "inp"}


def test_a_shift_that_stays_silent_ends_at_the_final_barrier() -> None:
    step = [ar(1, "acc"), ar(1, "loss")]
    out = simulate([step * 3 + [FIN], [*step, ar(1, "loss"), *step, FIN]], _two)
    assert out.state == "hang" and out.at == {0: "loss", 1: "finish"}


def test_the_truth_of_a_step_shift_follows_the_pairing_not_the_lines() -> None:
    """DDP, 2 ranks: rank 1 skips the loss all-reduce after backward at step 2. Its next
    collective is step 3's DDP bucket all-reduce, at an EARLIER line (backward), against rank
    0's loss: the culprit is ahead, not behind, and gloo aborts rank 0 (4-byte segments
    receive 164)."""
    fam = families.build("ddp", 2, shape="loss")
    t = truth.truth(fam, Plant("step_shift", "loss", 2, 4, "skip"), catalogue.kind("step_shift"),
                    frozenset({1}), frozenset({0}))
    rt = t.primary
    assert rt.outcome.state == "abort" and rt.outcome.abort == {0: "loss", 1: "backward"}
    # a skip: the others' line (the loss all-reduce rank 1 skipped) is the one required,
    # except on a rank gloo SIGABRTs (its recorder is never written: seed 27 job 24)
    assert rt.outcome.killed == {0}
    assert rt.env["FUZZ_DIVQ_LOSS"] == "0" and rt.env["FUZZ_DIVQ_BACKWARD"] == "1"
    four = truth.role_truth(families.build("ddp", 4, shape="loss"),
                            Plant("step_shift", "loss", 2, 4, "skip"),
                            catalogue.kind("step_shift"), frozenset({2}))
    assert four.outcome.killed == {1}  # rank 2's ring predecessor receives its segments
    assert four.env["FUZZ_DIV_LOSS"] == "0,3" and four.env["FUZZ_DIVQ_LOSS"] == "1"
    assert rt.env["FUZZ_AT_LOSS"] == "0" and rt.env["FUZZ_AT_BACKWARD"] == "1"
    assert t.verdicts == truth.DESYNC and t.fix_require == ()
    assert {"pad to a common size", "dummy input", "left the loop"} <= set(t.fix_forbid)


def test_a_silent_extra_on_a_mesh_ends_in_a_cross_group_wait() -> None:
    """A 2x2 mesh: rank 1 adds a size-1 all-reduce after its accuracy one, which pairs with
    the others' loss. Its own loss waits for a world collective nobody posts (the others are
    on in the next step), its tp peer (rank 0) waits for it in the next step's tp all-reduce,
    ranks 2 and 3 got through theirs and wait in dp for rank 0: a cycle across groups, which
    line order would read the other way round."""
    fam = families.build("mesh2d", 4, (2, 2), "loss")
    rt = truth.role_truth(fam, Plant("silent", "acc", 2, 4, "extra"), catalogue.kind("silent"),
                          frozenset({1}))
    assert rt.outcome.state == "hang"
    assert rt.outcome.at == {0: "tp_reduce", 1: "loss", 2: "dp_reduce", 3: "dp_reduce"}
    assert rt.env["FUZZ_DIV_EXTRA"] == "1" and rt.env["FUZZ_DIVQ_LOSS"] == "0,2,3"


def test_under_diagnose_the_shifted_kinds_name_no_divergence() -> None:
    """Stacks alone do not show which collective paired with which."""
    fam = families.build("p2p", 4, shape="ntok")
    plant = Plant("step_shift", "loss", 2, 4, "skip")
    kind = catalogue.kind("step_shift")
    watch = truth.role_truth(fam, plant, kind, frozenset({1}), "watch")
    seen = truth.role_truth(fam, plant, kind, frozenset({1}), "diagnose")
    assert {lt.where for lt in watch.lines} == {"rank", "divergence", "divergence?"}
    assert {lt.where for lt in seen.lines} == {"rank"}


# --- async posts, waited later --------------------------------------------------------------

def test_a_rank_in_wait_is_at_the_line_that_posted_its_first_unfinished_collective() -> None:
    step = [ar(1, "ntok", True), ar(1, "acc", True), ar(1, "loss", True), Wait("wait")]
    skipped = [ar(1, "ntok", True), ar(1, "loss", True), Wait("wait")]
    out = simulate([step * 2 + [FIN], skipped + step + [FIN]], _two)
    # rank 1's five posts pair silently with rank 0's first five; rank 0's sixth (its second
    # loss) meets rank 1's final barrier
    assert out.state == "hang"
    assert out.at == {0: "loss", 1: "finish"} and out.hidden == {0: "wait"}
    # stacks alone (diagnose) show rank 0 in its wait, not at the line that posted it
    assert visible_at(out, "diagnose") == {0: "wait", 1: "finish"}
    assert visible_at(out, "watch") == out.at


def test_async_posts_keep_the_rank_going_until_a_sync_collective() -> None:
    """Several in flight: rank 1 skipped its async token count; its forward all-gather meets
    rank 0's count (another op: both wait), rank 0 goes on to its own all-gather and blocks
    there. Rank 0's line is its token count, the oldest collective it posted that never
    completes (as its recorder shows it), not the all-gather on its stack (measured: fuzz
    seed 27 job 55, the tool named the async line)."""
    ag = Coll("world", "all_gather", "inp", "inp")
    out = simulate([[ar(1, "ntok", True), ag, Wait("wait"), FIN], [ag, Wait("wait"), FIN]],
                   _two)
    assert out.state == "hang" and out.at == {0: "ntok", 1: "inp"} and out.hidden == {0: "inp"}


def test_gloo_worker_threads_all_held_is_unpredictable() -> None:
    """Two posts of a group stuck for good hold both of gloo's worker threads: a third one
    that the model would complete never runs. Such a draw is drawn again."""
    ag = Coll("world", "all_gather", "inp", "inp", nowait=True)
    a = [ar(1, "x", True), ar(2, "y", True), ar(3, "z"), FIN]
    b = [ag, ag, ar(3, "z"), FIN]
    out = simulate([a, b], _two)
    assert out.state == "unknown" and "worker threads" in out.why
    # one held: the other worker runs the rest, until the step's wait
    one = simulate([[ar(2, "y", True), ar(3, "z"), Wait("wait"), FIN],
                    [ag, ar(3, "z"), Wait("wait"), FIN]], _two)
    assert one.state == "hang" and one.at == {0: "y", 1: "inp"} and \
        one.hidden == {0: "wait", 1: "wait"}
    assert one.posted == {0: {"world": 2}, 1: {"world": 2}}


def test_an_async_job_in_a_pipeline_runs_under_watch() -> None:
    fam = families.build("p2p", 2, shape="async")
    t = truth.truth(fam, Plant("async", "acc", 2, 4, "skip"), catalogue.kind("async"),
                    frozenset({1}), frozenset({0}), "watch")
    assert t.primary.outcome.at == {0: "loss", 1: "finish"}
    # rank 0 shows work.wait(), posted at `loss`
    assert t.primary.outcome.hidden == {0: "wait"}
    assert t.primary.env["FUZZ_AT_LOSS"] == "0" and t.primary.env["FUZZ_AT_FINISH"] == "1"


def test_under_diagnose_a_rank_in_work_wait_is_at_its_wait() -> None:
    """Stacks alone show the wait (``for work in pending: work.wait()``): no evidence names
    the line that posted the collective it waits on, so the truth asks for the wait's line."""
    fam = families.build("p2p", 2, shape="async")
    t = truth.truth(fam, Plant("async", "acc", 2, 4, "skip"), catalogue.kind("async"),
                    frozenset({1}), frozenset({0}), "diagnose")
    assert t.primary.env["FUZZ_AT_WAIT"] == "0" and t.primary.env["FUZZ_AT_FINISH"] == "1"
    assert "FUZZ_AT_LOSS" not in t.primary.env


# --- a metrics thread on a group of its own -------------------------------------------------

def test_the_waiting_rank_is_at_its_thread_collective() -> None:
    log = Coll("thread", "all_reduce", "f32x2", "logger", thread="metrics")
    main = [ar(4, "stats"), Join("metrics", "join"), FIN]
    out = simulate([[Fork("metrics", (log, log)), *main], [Fork("metrics", (log,)), *main]],
                   _two)
    assert out.state == "hang" and out.at == {0: "logger", 1: "finish"} and not out.hidden


@pytest.mark.parametrize("variant, at_logger", [("skip", "0,2,3"), ("extra", "1")])
def test_a_thread_plant_names_the_thread_line(variant: str, at_logger: str) -> None:
    fam = families.build("fsdp2", 4, shape="thread")
    rt = truth.role_truth(fam, Plant("thread", "put", 2, 4, variant), catalogue.kind("thread"),
                          frozenset({1}))
    prog = programs(fam, Plant("thread", "put", 2, 4, variant), frozenset({1}))[1]
    assert isinstance(prog[0], Fork) and prog[-2:] == [Join("metrics", "join"), FIN]
    assert len(prog[0].events) == (3 if variant == "skip" else 5)
    assert rt.env["FUZZ_AT_LOGGER"] == at_logger
    assert set(rt.env["FUZZ_AT_FINISH"].split(",")) == {"0", "1", "2", "3"} - \
        set(at_logger.split(","))
    # one line posts them all: the shift shows where one side posted a collective the other
    # never does (the culprit's last under an extra, the others' last under a skip)
    div = {(lt.marker, lt.where) for lt in rt.lines if lt.where != "rank"}
    assert div == {("logger", "divergence")}


# --- a rank-only evaluation under FSDP2 -----------------------------------------------------

@pytest.mark.parametrize("family", ["fsdp2", "fsdp2_moe"])
@pytest.mark.parametrize("variant", ["eval", "checkpoint"])
def test_a_rank_only_fsdp_eval_pairs_silently_and_breaks_in_the_backward(
        family: str, variant: str) -> None:
    """Measured (2 ranks): rank 1's evaluation all-gathers pair with rank 0's next forward,
    rank 0 goes into its backward and gloo aborts it there (216 vs 50 bytes)."""
    fam = families.build(family, 3)
    t = truth.truth(fam, Plant("fsdp_eval", "stop", 2, 4, variant), catalogue.kind("fsdp_eval"),
                    frozenset({1}), frozenset({2}))
    rt = t.primary
    assert rt.outcome.state == "broken" and rt.outcome.opaque == {0, 2}
    assert rt.env[truth.var(variant, "divergence")] == "1"
    assert rt.env["FUZZ_DIVQ_INP"] == "0,2" and rt.env["FUZZ_AT_BACKWARD"] == "0,2"
    assert t.verdicts == truth.DESYNC_OR_HANG
    assert {"dummy input", "every expert", "skip an expert"} <= set(t.fix_forbid)


# --- the busy neighbour ----------------------------------------------------------------------

def test_the_busy_neighbour_is_its_own_process_group_and_ends_with_the_block() -> None:
    with busy_neighbour(30.0) as pid:
        proc = psutil.Process(pid)
        assert os.getpgid(pid) == pid != os.getpgid(0)
        assert proc.status() != psutil.STATUS_ZOMBIE
    deadline = time.monotonic() + 5
    while psutil.pid_exists(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_the_busy_neighbour_stops_at_its_deadline() -> None:
    with busy_neighbour(0.3) as pid:
        proc = psutil.Process(pid)
        try:
            proc.wait(timeout=10)
        except psutil.TimeoutExpired:  # pragma: no cover - the failure this test is for
            pytest.fail("the neighbour outlived its deadline")
