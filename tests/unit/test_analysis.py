"""Analysis on recorded captures: pure, no processes."""

from __future__ import annotations

import json
import shutil

import pytest
from conftest import JOBS, ROOT, captured, relocated

from moe_hang.analysis.diagnosis import SCHEMA
from moe_hang.analysis.rules import diagnose
from moe_hang.commands.diagnose import analyze_paths
from moe_hang.evidence import flight_recorder as fr
from moe_hang.evidence.flight_recorder import PgStatus
from moe_hang.evidence.load import load_capture
from moe_hang.evidence.vocab import who


def _diag(path, **kw):
    return diagnose(load_capture(path, **kw)).to_dict()


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
    # the job's source is gone (it ran from /tmp) and this is its first collective: no
    # history, no majority of two, no source to order the lines — both are named
    assert d["culprit_ranks"] == [0, 1] and d["culprit_basis"] == "ambiguous"
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
        fr.loads(raw)
    except pickle.UnpicklingError as exc:
        assert "refusing global" in str(exc)
    else:
        raise AssertionError("a global in a dump was accepted")


def test_reads_torch_pickle_dump_of_gloo(fixtures):
    d = fr.load(fixtures / "op_mismatch" / "ranks" / "rank0.fr.pkl")
    assert d.backend == "gloo"
    assert [(c.pg, c.seq, c.op) for c in d.entries] == [("1", 1, "all_reduce"),
                                                        ("0", 1, "all_gather")]
    assert d.pg_status["0"] == PgStatus(enqueued=1, completed=-1)
    assert d.entries[1].frames[-1].function == "<module>"


@pytest.mark.parametrize("name, dead, dumped", [("gloo_abort_dumps_1", 1, [0, 2]),
                                                ("gloo_abort_dumps_0", 0, [1, 2])])
def test_torch_dumps_without_the_aborted_rank_say_what_would_settle_it(fixtures, name, dead,
                                                                      dumped):
    """torch's own pickle dumps of a 3-rank gloo MoE job with a hand-written gradient sync
    (fixtures/gloo_abort_dumps_job.py, and its mirror): one rank's batch routes no token to
    three experts, its `if p.grad is None: continue` skips their all-reduces, gloo aborts it
    (SIGABRT: no dump), the others raise in `w.wait()` and dump in their `except`. Every
    entry of theirs is retired — gloo retires a collective that failed as one that
    completed. Nothing decides: it says what is known, what is missing and what would
    settle it (was: a bare "not enough evidence", no advice)."""
    d = analyze_paths([fixtures / name], force=False)
    assert (d.verdict, d.culprit_ranks) == ("inconclusive", []), d.summary
    assert f"states known for ranks {dumped[0]}, {dumped[1]} only" in d.summary
    assert f"Rank {dead} left no Flight Recorder dump here" in d.summary
    assert f"The recorders of ranks {dumped[0]}, {dumped[1]} hold nothing pending" in d.summary
    assert "gloo retires a collective that failed as one that completed" in d.summary
    assert d.fix.startswith(f"What would settle it: rank {dead}'s dump or log")
    assert "moe-hang watch" in d.fix


def test_reads_torch_json_dump_format_by_rank_in_filename(fixtures):
    dumps, errors = fr.load_dir(fixtures / "fr_json")
    assert not errors and sorted(dumps) == [0, 1]
    assert [(c.seq, c.op) for c in dumps[1].entries if c.pg == "0"] == [(1, "barrier")]
    assert dumps[0].entries[0].input_sizes == [[4, 8]]


def test_everything_unreadable_is_inconclusive_not_a_crash(fixtures, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(fixtures / "op_mismatch", run)
    for p in (run / "ranks").iterdir():
        p.write_bytes(p.read_bytes()[:7])  # a rank died while writing
    (run / "stacks").mkdir()
    (run / "stacks" / "rank0.pyspy.json").write_text('[{"thread_name": "MainThread", "fra')
    d = _diag(run)
    _assert_schema(d)
    assert d["verdict"] == "inconclusive" and d["culprit_ranks"] == []
    assert any("unreadable" in e for e in d["evidence"])


def _ev(ranks):
    from moe_hang.evidence.model import Evidence

    return Evidence(ranks={r.rank: r for r in ranks}, world_size=len(ranks), job="stalled")


def _pyspy(*frames, active=False):
    from moe_hang.evidence.stacks import Frame, ThreadStack

    return [ThreadStack("MainThread", [Frame(*f) for f in frames], active=active, is_main=True)]


TORCH = "/x/site-packages/torch/distributed/distributed_c10d.py"


@pytest.mark.parametrize("looped", [False, True])
def test_stacks_alone_name_the_rank_that_went_past(tmp_path, looped):
    """Rank 0 in step()'s all-reduce, rank 1 in the barrier after it: once, rank 1 went past
    the all-reduce. In a loop that calls step() every iteration either may be ahead (rank 0 a
    lap on, past the barrier): nothing the source shows decides, so both are named."""
    from conftest import captured

    from moe_hang.evidence.model import RankEvidence

    job = tmp_path / "train.py"
    body = "def step():\n    dist.all_reduce(x)\n\n"
    body += ("for i in range(9):\n    step()\n    dist.barrier()\n" if looped
             else "step()\ndist.barrier()\n")
    job.write_text(body)
    call, bar = (5, 6) if looped else (4, 5)
    r0 = RankEvidence(rank=0, alive=True, progressed=False, stack_source="py-spy",
                      threads=_pyspy((TORCH, 10, "all_reduce"), (str(job), 2, "step"),
                                     (str(job), call, "<module>")))
    r1 = RankEvidence(rank=1, alive=True, progressed=False, stack_source="py-spy",
                      threads=_pyspy((TORCH, 20, "barrier"), (str(job), bar, "<module>")))
    d = diagnose(captured(_ev([r0, r1]))).to_dict()
    assert d["verdict"] == "desync" and d["first_divergence"]["seq"] is None
    assert d["culprit_ranks"] == ([0, 1] if looped else [1]), d["summary"]
    assert "from stacks alone" in d["summary"]
    r0.threads = _pyspy((TORCH, 10, "all_reduce"), ("/gone/train.py", 2, "step"),
                        ("/gone/train.py", call, "<module>"))
    r1.threads = _pyspy((TORCH, 20, "barrier"), ("/gone/train.py", bar, "<module>"))
    blind = diagnose(_ev([r0, r1])).to_dict()  # no source: line numbers order nothing
    assert blind["culprit_ranks"] == [0, 1] and blind["culprit_basis"] == "ambiguous"


@pytest.mark.parametrize("moving", [True, False])
def test_orphans_of_a_dead_agent_in_flight_are_not_a_desync(moving):
    """The agent died under a healthy job: its ranks keep stepping, and a snapshot can catch
    one in the all_gather and the next already in the all_reduce. Only ranks that did not move
    while captured can be in a desync."""
    from moe_hang.evidence.model import Evidence, RankEvidence

    r0 = RankEvidence(rank=0, alive=True, progressed=moving, stack_source="py-spy",
                      threads=_pyspy((TORCH, 10, "all_gather"), ("/job/train.py", 30, "step"),
                                     ("/job/train.py", 50, "<module>")))
    r1 = RankEvidence(rank=1, alive=True, progressed=moving, stack_source="py-spy",
                      threads=_pyspy((TORCH, 20, "all_reduce"), ("/job/train.py", 31, "step"),
                                     ("/job/train.py", 50, "<module>")))
    ev = Evidence(ranks={0: r0, 1: r1}, world_size=2, job="failed", agent_exit_code=-9)
    d = diagnose(ev).to_dict()
    if moving:
        assert d["verdict"] == "crash" and d["first_divergence"] is None
        assert "torchrun agent" in d["summary"] and "still running" in d["summary"]
    else:
        assert d["verdict"] == "desync"


def test_a_computing_rank_is_a_straggler_not_a_hang():
    from moe_hang.evidence.model import RankEvidence

    waiting = RankEvidence(rank=0, alive=True, progressed=False,
                           threads=_pyspy((TORCH, 10, "all_reduce"), ("/job/t.py", 3, "f")))
    busy = RankEvidence(rank=1, alive=True, progressed=True,
                        threads=_pyspy(("/job/t.py", 9, "compute"), active=True))
    d = diagnose(_ev([waiting, busy])).to_dict()
    assert d["verdict"] == "straggler" and d["culprit_ranks"] == [1]


def test_same_op_same_size_but_different_expert_is_a_skip():
    """FSDP all-gathers of two experts look identical to the recorder; the probe's tags don't."""
    from moe_hang.evidence.model import RankEvidence
    from moe_hang.evidence.probe_records import PostedRecord

    def recs(tags, start=10):
        return [PostedRecord(seq=start + i, op="all_gather", pg="0", phase="forward", tag=t,
                             name="fsdp_unshard") for i, t in enumerate(tags)]

    r0 = RankEvidence(rank=0, alive=True, progressed=False,
                      records=recs(["l1.e0", "l1.e1", "l1.e3"]))
    r1 = RankEvidence(rank=1, alive=True, progressed=False,
                      records=recs(["l1.e0", "l1.e1", "l1.e2", "l1.e3"]))
    d = diagnose(_ev([r0, r1])).to_dict()
    fd = d["first_divergence"]
    assert d["verdict"] == "desync" and d["culprit_ranks"] == [0]
    assert (fd["seq"], fd["kind"]) == (12, "missing_rank")
    assert "never posted the all_gather of l1.e2" in d["summary"]


def test_heartbeats_alone_catch_a_size_mismatch():
    from moe_hang.analysis.align import quick_divergence
    from moe_hang.evidence.probe_records import Heartbeat

    def hb(rank, rows):
        return Heartbeat.parse({"rank": rank, "pid": 100 + rank, "pg_status": {"0": {"enqueued": 5,
                                                                     "completed": 4}},
                "pending": [{"pg_id": 0, "process_group": ["0", "default_pg"],
                             "collective_seq_id": 5, "profiling_name": "nccl:all_gather",
                             "input_sizes": [[rows, 64]], "input_dtypes": ["Float"]}]})

    div = quick_divergence({0: hb(0, 68), 1: hb(1, 401)}, 2)
    assert div is not None and (div.seq, div.kind) == (5, "size_mismatch")
    assert quick_divergence({0: hb(0, 68), 1: hb(1, 68)}, 2) is None


@pytest.mark.parametrize("barrier_first", [True, False])
def test_two_groups_each_missing_a_rank_blames_the_one_that_went_past(barrier_first):
    """Rank 3 skipped group 2's all-reduce and waits in the barrier; rank 2 waits in that
    all-reduce, so it is also missing from the barrier. Only rank 3 skipped anything,
    whichever collective the recorder saw first."""
    from moe_hang.evidence.model import RankEvidence
    from moe_hang.evidence.probe_records import Heartbeat, PostedRecord

    t_ar, t_bar = (2e18, 1e18) if barrier_first else (1e18, 2e18)

    def rec(seq, op, pg, t):
        return PostedRecord(seq=seq, op=op, pg=pg,
                            input_sizes=[[4]] if op != "barrier" else [], time=t / 1e9)

    warm = [rec(1, "all_reduce", "0", 1e17), rec(2, "all_reduce", "0", 1.1e17)]
    sub = [rec(1, "all_reduce", "2", 1.2e17), rec(2, "all_reduce", "2", 1.3e17)]
    job = "/job/subgroup.py"
    at_barrier = _pyspy((TORCH, 5, "barrier"), (job, 22, "<module>"))
    at_reduce = _pyspy((TORCH, 9, "all_reduce"), (job, 17, "reduce_expert_grads"),
                       (job, 20, "<module>"))
    ranks = []
    for r in range(4):
        records = list(warm)
        if r in (2, 3):
            records += sub
        if r == 2:
            records.append(rec(3, "all_reduce", "2", t_ar))
        else:
            records.append(rec(3, "barrier", "0", t_bar))
        ev = RankEvidence(rank=r, alive=True, progressed=False, records=records,
                          threads=at_reduce if r == 2 else at_barrier,
                          groups={"0": [0, 1, 2, 3], "2": [2, 3]})
        ev.heartbeat = Heartbeat.parse({
            "rank": r, "pg_status": {"0": {"enqueued": 3 if r != 2 else 2, "completed": 2},
                                     "2": {"enqueued": 3 if r == 2 else 2, "completed": 2}}})
        ranks.append(ev)
    d = diagnose(_ev(ranks)).to_dict()
    assert d["verdict"] == "desync" and d["culprit_ranks"] == [3]
    assert d["first_divergence"]["pg"] == "2" and d["first_divergence"]["ranks"] == [2, 3]


def test_gloo_size_abort_found_past_the_first_notable_log_lines(tmp_path):
    """The abort line can come after more notable lines than the evidence list keeps."""
    from moe_hang.evidence.model import SizeAbort
    from moe_hang.evidence.torchrun_log import gloo_size_abort, notable_log_lines

    run = tmp_path / "run"
    (run / "ranks").mkdir(parents=True)
    (run / "processes.json").write_text(json.dumps({
        "world_size": 2, "job": "stalled",
        "ranks": {"0": {"pid": 100, "alive": False, "exit_code": -6},
                  "1": {"pid": 101, "alive": True, "progressed": False}}}))
    (run / "ranks" / "rank1.tokens.jsonl").write_text(json.dumps(
        {"seq": 1, "op": "all_gather", "pg": "0", "input_sizes": [[401, 64]], "time": 1.0}) + "\n")
    abort = ("  what():  [enforce fail at /gloo/transport/tcp/pair.cc:456] op.preamble.length "
             "<= op.nbytes. 51328 vs 8704. Received data size doesn't match expected size.")
    noise = [f"[rank1]: RuntimeError: unrelated warning number {i}" for i in range(12)]
    log = "\n".join([*noise, abort]) + "\n"
    (run / "job.log").write_text(log)
    assert len(notable_log_lines(log)) == 8
    assert not any("Received data size" in line for line in notable_log_lines(log))
    assert gloo_size_abort(log) == SizeAbort(51328, 8704)
    assert gloo_size_abort("\n".join(noise)) is None

    d = _diag(run)
    _assert_schema(d)
    assert d["verdict"] == "desync"
    fd = d["first_divergence"]
    assert (fd["pg"], fd["seq"], fd["kind"]) == ("0", 1, "size_mismatch")
    assert "gloo aborted rank 0: it received 51328 bytes where it expected 8704" in d["summary"]


def test_a_huge_job_log_is_read_from_its_end(tmp_path):
    """A long job's output can be gigabytes; the failure summary is at the end."""
    from moe_hang.evidence.torchrun_log import read_job_log

    with open(tmp_path / "job.log", "wb") as f:
        f.write(b"step 1 loss 2.0\n" * 4096)
        f.write(b"[rank1]: RuntimeError: boom\n")
    text = read_job_log(tmp_path / "job.log", max_bytes=1024)
    assert len(text) <= 1024 and text.endswith("[rank1]: RuntimeError: boom\n")
    assert read_job_log(tmp_path / "missing") == ""


def test_progress_between_two_py_spy_samples():
    """Same frames off CPU is stuck, unless the process kept cores busy outside a collective
    (OpenMP workers computing while the main thread waits for them in a futex)."""
    from moe_hang.commands.diagnose import progressed

    def sample(*frames, active=False):
        return [{"thread_name": "MainThread", "active": active,
                 "frames": [{"filename": f, "line": n, "name": fn} for f, n, fn in frames]}]

    computing = sample(("/job/t.py", 9, "forward"), ("/job/t.py", 30, "<module>"))
    waiting = sample((TORCH, 10, "all_reduce"), ("/job/t.py", 31, "<module>"))
    assert progressed(computing, computing) is False
    assert progressed(computing, computing, cpu_cores=1.5) is True
    assert progressed(computing, computing, cpu_cores=0.01) is False
    assert progressed(waiting, waiting, cpu_cores=1.5) is False  # a spin-wait is not progress
    assert progressed(computing, waiting) is True
    busy = sample(("/job/t.py", 9, "forward"), active=True)
    assert progressed(busy, busy) is True


@pytest.mark.parametrize("name, wrong, right", [("mesh_wrong_group_0", [2, 3], [0, 1]),
                                               ("mesh_wrong_group_1", [0, 1], [2, 3])])
def test_a_gather_on_the_wrong_mesh_dim_is_named_as_such(fixtures, name, wrong, right):
    """A real 2×2 mesh job (tests/corpus/jobs/mesh_wrong_group.py) and its mirror: the ranks
    that gathered over tp instead of ep are the culprits, and the advice is to pass the same
    group — not to 'post that too', which they did, on the other group."""
    d = _diag(fixtures / name)
    assert d["verdict"] == "desync"
    assert d["culprit_ranks"] == wrong
    a, b = wrong
    assert d["summary"].startswith(f"Ranks {a}, {b} posted the all_gather at "
                                   "mesh_wrong_group.py:20 on mesh_tp instead of mesh_ep")
    assert f"ranks {right[0]}, {right[1]} wait for them" in d["summary"]
    assert "pass the same group" in d["fix"]
    assert "post that too" not in d["fix"]


@pytest.mark.parametrize("name, culprit, waiter, went_with",
                         [("mesh8_redirect_0", 4, 0, "ranks 5-7"),
                          ("mesh8_redirect_1", 0, 4, "ranks 1-3")])
def test_a_redirect_on_a_bigger_mesh_names_the_rank_not_the_ones_it_went_with(
        fixtures, tmp_path, name, culprit, waiter, went_with):
    """A generated 2×4 mesh job (fuzz seed 699437, job 021) and its mirror: one rank posted
    the data-parallel all-reduce on its tp group. The tp peers it went ahead with are on the
    wait-for cycle too, yet only the redirect explains it: the culprit is that one rank,
    still in the redirected call, and its dp peer waits for it."""
    run = relocated(fixtures / name, tmp_path / "run", "/work/main/runs/fuzz-699437/jobs",
                    str(fixtures / "fuzz699437_jobs"))
    d = _diag(run)
    assert d["verdict"] == "desync" and d["culprit_ranks"] == [culprit], d["summary"]
    assert d["summary"].startswith(
        f"Rank {culprit} posted the all_reduce at fuzz699437_021_wrong_group_mesh2d.py:50 on "
        f"mesh_tp instead of mesh_dp and waits in it for {went_with}; rank {waiter} waits for "
        "it"), d["summary"]
    assert "pass the same group" in d["fix"] and "post that too" not in d["fix"]


@pytest.mark.parametrize("name, ahead, behind", [("mesh6_stacks_0", [3, 4, 5], [0, 1, 2]),
                                                 ("mesh6_stacks_1", [0, 1, 2], [3, 4, 5])])
def test_a_redirect_seen_in_stacks_alone_names_the_ranks_that_went_past(
        fixtures, tmp_path, name, ahead, behind):
    """`moe-hang diagnose` on a generated 2×3 mesh job without the probe (fuzz seed 699437,
    job 011) and its mirror: one tp row posted the dp all-reduce on tp and went on to the
    next all-reduce. py-spy shows one op at two lines of the loop: the row at the later line
    went past the earlier; which group it used is for the recorder to say, so the advice
    says both possibilities."""
    run = relocated(fixtures / name, tmp_path / "run", "/work/main/runs/fuzz-699437/jobs",
                    str(fixtures / "fuzz699437_jobs"))
    d = _diag(run)
    assert (d["verdict"], d["culprit_ranks"]) == ("desync", ahead), d["summary"]
    assert d["summary"].startswith("Ranks wait in all_reduce at different lines")
    assert "skipped it or posted it on another group" in d["fix"], d["fix"]


@pytest.mark.parametrize("name, culprit, waiter", [("pipeline_unsent_0", 1, 2),
                                                   ("pipeline_unsent_1", 0, 1)])
def test_a_pipeline_stage_that_went_past_its_send_is_the_culprit_from_stacks(
        fixtures, tmp_path, name, culprit, waiter):
    """`diagnose` on a generated 4-stage send/recv pipeline (fuzz seed 8123057, job 067) and
    its mirror: one stage skips its send and goes on to the loss all-reduce. py-spy's locals
    name each recv's peer: the stage waited on that is inside a collective went past the
    send it owed; the stages after it wait stage by stage. It named the two ranks in the
    all-reduce, and 'post the collective at the recv's line'."""
    run = relocated(fixtures / name, tmp_path / "run", "/work/main/runs/fuzz-8123057/jobs",
                    str(fixtures / "fuzz8123057_jobs"))
    d = _diag(run)
    assert (d["verdict"], d["culprit_ranks"]) == ("desync", [culprit]), d["summary"]
    assert d["fix"].startswith(f"Rank {waiter}'s recv(src={culprit}) at "), d["fix"]
    assert f"post the matching send(dst={waiter}) on rank {culprit}" in d["fix"]


@pytest.mark.parametrize("name, culprit", [("dtype_abort_moe_0", 2), ("dtype_abort_moe_1", 1)])
def test_an_aborted_rank_of_unknown_dtype_is_no_camp_of_its_own(fixtures, tmp_path, name,
                                                               culprit):
    """Fuzz seed 8123057 job 079 (FSDP2 MoE, 4 ranks; one all-gathers float64 where the others
    gather float32; gloo aborts a peer, whose recorder dies with it) and its mirror: three
    known dtypes, two of them float32 — the aborted rank, placed there by its peers with no
    dtype of its own, made it "ranks 2, 3", a tie of two camps and a half."""
    run = relocated(fixtures / name, tmp_path / "run", "/work/main/runs/fuzz-8123057/jobs",
                    str(fixtures / "fuzz8123057_jobs"))
    d = _diag(run)
    # the camps' readings go to the one ladder: the float64 is not the shape this
    # all-gather had in every agreed step (history, before the count of ranks)
    assert (d["verdict"], d["culprit_ranks"], d["culprit_basis"]) == (
        "desync", [culprit], "history"), d["summary"]
    assert d["fix"].startswith("Cast to one dtype on every rank"), d["fix"]
    # the summary shows the dtype that differs (it said "ranks 0-2 all_gather(3)")
    assert f"rank {culprit} all_gather(3) Double" in d["summary"], d["summary"]


@pytest.mark.parametrize("name, killed", [("sigkill_stale_hb_0", 3), ("sigkill_stale_hb_1", 0)])
def test_a_killed_ranks_last_heartbeat_contradicts_nothing(fixtures, tmp_path, name, killed):
    """Fuzz seed 8123057 job 026 (FSDP2, 4 ranks; one SIGKILLed between the metrics
    all-gather and the stop broadcast) and its mirror: its only stack is its last
    heartbeat's sample, a backward reduce-scatter steps before; its peers completing what
    came after is what a beat-old sample means, not a contradiction (it said "its own
    records and its peers' disagree" and lowered the verdict to likely)."""
    run = relocated(fixtures / name, tmp_path / "run", "/work/main/runs/fuzz-8123057/jobs",
                    str(fixtures / "fuzz8123057_jobs"))
    d = _diag(run)
    assert (d["verdict"], d["culprit_ranks"], d["certainty"]) == (
        "rank_died", [killed], "definite"), d["summary"]
    assert d["summary"].startswith(f"Rank {killed} was killed by SIGKILL mid-step")
    assert "disagree" not in d["summary"]


@pytest.mark.parametrize("name, skipper, waiter", [("subgroup_skip_3", 3, 2),
                                                   ("subgroup_skip_2", 2, 3)])
def test_a_rank_left_out_by_if_rank_ne_k_skipped_its_groups_collective(
        fixtures, tmp_path, name, skipper, waiter):
    """4 ranks in expert groups {0, 1}, {2, 3}; ``if rank != k: reduce_expert_grads(...)``
    (fixtures/subgroup_skip_jobs, recorded under watch) and its mirror. In the group, one
    rank posts the all-reduce and one does not: the condition names the rank that skips it,
    so that rank is the culprit — not its peer, the one that took the branch every other
    rank took."""
    jobs = fixtures / "subgroup_skip_jobs"
    run = relocated(fixtures / name, tmp_path / "run",
                    "/work/main/tests/unit/fixtures/subgroup_skip_jobs", str(jobs))
    d = _diag(run)
    assert (d["verdict"], d["culprit_ranks"], d["culprit_basis"]) == (
        "desync", [skipper], "source"), d["summary"]
    assert d["fix"].startswith(f"Rank {skipper} does not take `if rank != {skipper}`, so it "
                               "never posts the all_reduce group 2 ("), d["fix"]
    assert f"that rank {waiter} waits in" in d["fix"]


@pytest.mark.parametrize("name, evaluator, other", [("fsdp2_eval_stale_0", 0, 1),
                                                     ("fsdp2_eval_stale_1", 1, 0)])
def test_a_dead_ranks_stale_count_does_not_place_it_before_what_its_peer_completed(
        fixtures, tmp_path, name, evaluator, other):
    """tests/corpus/jobs/fsdp2_rank0_eval.py and its mirror, recorded where gloo aborted the
    other rank before its heartbeat or its recorder's save saw more than step 0: its stack
    (all-gather, backward line) matches many earlier seqs, but its peer completed every
    collective up to the one it could not (each needed the dead rank). It died there — the
    peer's forward all-gather met its backward one — so the evaluation's all-gathers, under a
    rank condition, are what the evaluator alone posted."""
    from tests.conftest import ROOT

    run = relocated(fixtures / name, tmp_path / "run", "/work/main", str(ROOT))
    d = _diag(run)
    # from evaluate(), a path no agreed step ever posted from (history, before the source)
    assert (d["verdict"], d["culprit_ranks"], d["culprit_basis"]) == (
        "desync", [evaluator], "history"), d["summary"]
    assert d["summary"].startswith(f"Rank {evaluator} posted 4 all_gathers from evaluate() at "
                                   f"{ROOT}/tests/corpus/jobs/fsdp2_rank0_eval.py:34 that "
                                   f"rank {other} never posted"), d["summary"]
    assert "Run it on every rank" in d["fix"], d["fix"]


@pytest.mark.parametrize("name, saver", [("best_checkpoint_2", 2), ("best_checkpoint_0", 0)])
def test_an_extra_posted_after_the_others_line_in_its_pass_names_its_branch(
        fixtures, tmp_path, name, saver):
    """tests/corpus/jobs/best_checkpoint.py and its mirror, recorded under watch: each rank
    saves the best model with torch.distributed.checkpoint where its own validation score
    improved; at step 4 only one does, and its save's all-gather (line 51) meets the
    others' next DDP backward (line 44). The saver went through line 44 in its pass (every
    pass posts it): its collective is the extra, inside the branch its data took — the fix
    names `if val < best:` (line 49). Was: "every rank must post the same collectives in
    the same order", no branch."""
    from tests.conftest import ROOT

    run = relocated(fixtures / name, tmp_path / "run", "/work/main", str(ROOT))
    d = _diag(run)
    assert (d["verdict"], d["culprit_ranks"], d["culprit_basis"]) == (
        "desync", [saver], "majority"), d["summary"]
    assert "in `if val < best:`" in d["fix"] and f"held on rank {saver} alone" in d["fix"]
    assert d["fix_site"]["line"] == 49, d["fix_site"]


def test_an_extra_is_put_in_a_branch_only_where_the_ranks_were_seen_in_step_before(
        fixtures, tmp_path):
    """The same capture (best_checkpoint_2), its recorders without call sites (as the
    periodic saves are where no probe answered): nothing shows the ranks in step at the
    collective before the divergence — a silent pairing before it may have shifted them (the
    review's case: a skip earlier, then one rank alone in `if step % 2 == 0:`) — so the
    branch around the saver's collective is not named as the decision."""
    from tests.conftest import ROOT

    run = relocated(fixtures / "best_checkpoint_2", tmp_path / "run", "/work/main", str(ROOT))
    for log in (run / "ranks").glob("rank*.posted.jsonl"):
        recs = [json.loads(x) for x in log.read_text().splitlines()]
        for rec in recs:
            rec.pop("stack", None)
        log.write_text("".join(json.dumps(rec) + "\n" for rec in recs
                               if rec.get("kind") != "stack"))
    d = _diag(run)
    assert d["culprit_ranks"] == [2], d["summary"]
    assert "if val < best" not in d["fix"], d["fix"]


@pytest.mark.parametrize("name, easy", [("hook_sync_skip_1", 1), ("hook_sync_skip_2", 2)])
def test_a_rank_past_the_loop_others_post_from_a_gradient_hook_in(fixtures, tmp_path, name,
                                                                 easy):
    """tests/corpus/jobs/hook_sync_skip.py and its mirror, recorded under watch: gradients
    all-reduced from post-accumulate-grad hooks; one rank's easy batch skips a block, whose
    parameters' hooks never post. It ends in the final barrier, the others in their last
    hook all-reduces. The recorder's frames show the hook called from inside backward by
    the engine: the advice says a parameter without a gradient posts nothing there (was:
    "ran different numbers of iterations, or cut one short", nothing of the hook)."""
    from tests.conftest import ROOT

    run = relocated(fixtures / name, tmp_path / "run", "/work/main", str(ROOT))
    d = _diag(run)
    assert (d["verdict"], d["culprit_ranks"]) == ("desync", [easy]), d["summary"]
    assert f"theirs is posted by sync() ({ROOT}/tests/corpus/jobs/hook_sync_skip.py:40) " \
        "from inside backward, a gradient hook" in d["fix"], d["fix"]
    assert "Give every parameter a gradient every step" in d["fix"]


def test_a_saved_recorder_pending_in_a_collective_is_not_where_the_rank_died(fixtures,
                                                                           tmp_path):
    """tests/corpus/jobs/rank0_eval_collective.py mirrored (rank 1 evaluates), recorded where
    the probe's last save of rank 1's recorder caught it inside step 1's all-reduce: gloo
    aborted it later, in evaluate()'s all-reduce, which its peers (gone on to step 2's)
    could not complete. It is placed there, and the majority names it."""
    from tests.conftest import ROOT

    run = relocated(fixtures / "eval_pending_save", tmp_path / "run", "/work/main", str(ROOT))
    d = _diag(run)
    # its all-reduce is not what followed in every earlier step (history, before the majority)
    assert (d["verdict"], d["culprit_ranks"], d["culprit_basis"]) == (
        "desync", [1], "history"), d["summary"]
    assert "rank 1 all_reduce at" in d["summary"] and "evaluate" in d["summary"], d["summary"]


def test_a_skipped_collective_is_not_called_a_wrong_group(fixtures):
    d = _diag(fixtures / "op_mismatch")
    assert "same group" not in (d["fix"] or "") and "instead of" not in d["summary"]


@pytest.mark.parametrize("name, short, other", [("ddp_uneven_0", 1, 0), ("ddp_uneven_1", 0, 1)])
def test_a_rank_that_ran_out_of_batches_left_the_loop(fixtures, tmp_path, name, short, other):
    """tests/corpus/jobs/ddp_uneven_batches.py and its mirror, recorded: the rank with one
    batch fewer is past the loop in the validation all-reduce while the other waits in DDP's
    backward all-reduce; the advice says they ran different numbers of iterations."""
    from tests.conftest import ROOT

    run = relocated(fixtures / name, tmp_path / "run", "/work/refactor", str(ROOT))
    d = _diag(run)
    assert d["verdict"] == "desync" and d["culprit_ranks"] == [short], d["summary"]
    job = "tests/corpus/jobs/ddp_uneven_batches.py"
    loop = next(i for i, ln in enumerate((ROOT / job).read_text().splitlines(), 1)
                if ln.startswith("for step"))
    assert d["fix"].startswith(f"Rank {short} left the loop at {ROOT / job}:{loop} while rank "
                               f"{other} is still in it"), d["fix"]
    assert "different numbers of iterations" in d["fix"]


def test_a_rank_that_died_faster_than_its_heartbeat_is_placed_by_its_fatal_stack(fixtures,
                                                                                  tmp_path):
    """Recorded (the mirror of ddp_uneven_batches under CPU load): rank 0 ran its whole loop
    between two heartbeats, so its last beat still shows DDP's start-up all-gather pending
    (line 14); gloo then aborted it inside the validation all-reduce, and the stack it died
    with (line 34) is the fresher evidence, in the summary and in its line."""
    from tests.conftest import ROOT

    run = relocated(fixtures / "ddp_uneven_stale_hb", tmp_path / "run", "/work/refactor",
                     str(ROOT))
    d = _diag(run)
    assert d["culprit_ranks"] == [0], d["summary"]
    job = str(ROOT / "tests/corpus/jobs/ddp_uneven_batches.py")
    assert f"rank 0 all_reduce at {job}:34" in d["summary"], d["summary"]
    r0 = next(r for r in d["ranks"] if r["rank"] == 0)
    assert r0["callsite"]["line"] == 34 and ":14" not in d["summary"]


@pytest.mark.parametrize("name, skipper", [("fsdp2_moe_skip_abort_2", 2),
                                           ("fsdp2_moe_skip_abort_3", 3)])
def test_an_aborted_rank_that_left_the_expert_loop_early_lacks_the_others_all_gather(
        fixtures, tmp_path, name, skipper):
    """FSDP2 experts (fixtures/fsdp2_moe_skip_jobs, fuzz seed 31415 job 15, recorded under
    watch, and its mirror): the skipper routed no token to one expert, so its other experts'
    all-gathers paired silently with the others' and its head's all-gather (:60) met their
    last expert's (:59); gloo aborted it. In the others' own order :59 runs straight into :60,
    never back: the skipper went on past their run, so it never posted their collective and
    the divergence's line is theirs (:59), not where the skipper died."""
    jobs = fixtures / "fsdp2_moe_skip_jobs"
    run = relocated(fixtures / name, tmp_path / "run", "/work/main/runs/fuzz-31415/jobs",
                    str(jobs))
    d = _diag(run)
    assert (d["verdict"], d["culprit_ranks"], d["culprit_basis"]) == (
        "desync", [skipper], "majority"), d["summary"]
    per = d["first_divergence"]["per_rank"]
    assert per[str(skipper)] is None
    assert {per[str(r)]["callsite"]["line"] for r in range(4) if r != skipper} == {59}
    # its seqs before the one it died in, held by no dump of its: posted, not known
    # (never the "never posted" of a rank that did not get there)
    tl = d["timeline"]
    row = tl["ranks"][str(skipper)]
    assert [c["state"] if c else None for c in row[:-1]] == ["unknown"] * (len(row) - 1), row
    assert f"rank {skipper} never posted it" in d["summary"]
    assert "called fewer modules" in d["fix"] and ":59" in d["fix"]


@pytest.mark.parametrize("name, waiter, at50, at53", [("mesh_skip_stacks_3", 2, [0], [1, 3]),
                                                      ("mesh_skip_stacks_0", 1, [3], [0, 2])])
def test_stacks_alone_ranks_past_a_group_collective_at_different_lines(
        fixtures, tmp_path, name, waiter, at50, at53):
    """A 2x2 mesh under diagnose, no probe (fixtures/mesh_skip_stacks_jobs, fuzz seed
    20261202 job 18, and its mirror): the skipper left its tp all-reduce (:47) out; its tp
    peer waits there, that peer's dp peer waits at :50, the other two at :53. The stacks show
    who is past :47, not which of them shares the waiter's group: the advice says where each
    is and that, never that all of them "went on to" one line."""
    jobs = fixtures / "mesh_skip_stacks_jobs"
    run = relocated(fixtures / name, tmp_path / "run", "/work/main/runs/fuzz-20261202/jobs",
                    str(jobs))
    d = _diag(run)
    assert d["verdict"] == "desync" and d["culprit_ranks"] == sorted(at50 + at53), d["summary"]
    fix = d["fix"]
    assert fix.startswith(f"Rank {waiter} waits in the collective at "), fix
    assert ":47 <module>" in fix.split(";")[0]
    one = "rank" if len(at50) == 1 else "ranks"
    assert f"{one} {', '.join(map(str, at50))} at " in fix and ":50 <module>" in fix, fix
    assert f"ranks {', '.join(map(str, at53))} at " in fix and ":53 <module>" in fix, fix
    assert "the stacks do not say which ranks that group holds" in fix
    assert "went on to" not in fix


@pytest.mark.parametrize("name, busy, tp_peer, dp_waiters", [("busy_mesh_stacks_0", 0, 1, [2, 3]),
                                                            ("busy_mesh_stacks_2", 2, 3, [0, 1])])
def test_stacks_alone_ranks_past_a_subgroup_collective_wait_for_a_busy_rank(
        fixtures, tmp_path, name, busy, tp_peer, dp_waiters):
    """A 2x2 mesh under diagnose, no probe (fixtures/busy_mesh_jobs, fuzz seed 4071993 job
    75, and its mirror): one rank computes for 60 s before its tp all-reduce (:56). Its tp
    peer waits there; the other tp pair completed its own tp all-reduce and waits at the dp
    all-reduce (:59) for the busy rank and its peer. Being past a collective of a subgroup
    is not skipping it while a rank still computes: a straggler (was: a desync naming the
    two at :59, "make every rank post it, on the same group")."""
    jobs = fixtures / "busy_mesh_jobs"
    run = relocated(fixtures / name, tmp_path / "run", "/work/main/runs/fuzz-4071993-b/jobs",
                    str(jobs))
    d = _diag(run)
    assert (d["verdict"], d["culprit_ranks"]) == ("straggler", [busy]), d["summary"]
    ranks = {r["rank"]: r for r in d["ranks"]}
    assert ranks[tp_peer]["callsite"]["line"] == 56
    assert {ranks[r]["callsite"]["line"] for r in dp_waiters} == {59}
    assert "same group" not in d["fix"]


@pytest.mark.parametrize("name, locked", [("lock_backward_stacks_0", 0),
                                          ("lock_backward_stacks_1", 1)])
def test_stacks_alone_ranks_idle_in_backward_wait_for_a_rank_outside_it(
        fixtures, tmp_path, name, locked):
    """DDP, 4 ranks, under diagnose without a probe (fixtures/lock_backward_jobs, fuzz seed
    4071993 job 81, and its mirror): one rank deadlocks on two locks of its own before its
    forward (:57 checkpoint_state); the other three sit idle in `loss.backward()` (:73), where
    DDP's hooks all-reduce the gradients on a thread py-spy does not show. No stack is inside
    a collective, yet the three in the autograd engine wait for the one outside it: a hang
    with that rank as culprit (was: inconclusive, "all 4 ranks were in ?")."""
    jobs = fixtures / "lock_backward_jobs"
    run = relocated(fixtures / name, tmp_path / "run", "/work/main/runs/fuzz-4071993-b/jobs",
                    str(jobs))
    d = _diag(run)
    assert (d["verdict"], d["culprit_ranks"]) == ("hang", [locked]), d["summary"]
    assert d["summary"].startswith(f"Rank {locked} is outside any collective"), d["summary"]
    assert ":57 checkpoint_state" in d["summary"]
    others = "1-3" if locked == 0 else "0, 2, 3"
    assert f"ranks {others}, idle inside backward at " in d["summary"]
    assert d["summary"].endswith(":73 <module>, wait for it."), d["summary"]


@pytest.mark.parametrize("name, locked, behind, ahead", [("mesh_lock_behind_1", 1, 3, 2),
                                                         ("mesh_lock_behind_3", 3, 1, 0)])
def test_a_rank_held_up_behind_a_broadcast_did_not_skip_its_next_collective(
        fixtures, tmp_path, name, locked, behind, ahead):
    """A 2x2 mesh under watch (fixtures/mesh_lock_jobs, fuzz seed 20261202 job 50, and its
    mirror): one rank deadlocks on two locks of its own before the step's broadcast from rank
    0. gloo's broadcast is a tree: the root's direct child got its data and went on to the
    next step's tp all-reduce, where its tp peer never comes — that peer still waits in the
    broadcast, for the locked rank. The peer completed nothing of the broadcast its tp partner
    completed: it is behind, not past, so the tp "missing" is a consequence and the locked
    rank, outside any collective, is the culprit (was: a desync blaming the peer)."""
    jobs = fixtures / "mesh_lock_jobs"
    run = relocated(fixtures / name, tmp_path / "run", "/work/main/runs/fuzz-20261202/jobs",
                    str(jobs))
    d = _diag(run)
    assert d["verdict"] == "hang" and d["culprit_ranks"] == [locked], d["summary"]
    assert d["summary"].startswith(f"Rank {locked} is outside any collective"), d["summary"]
    assert ":57 checkpoint_state" in d["summary"]
    ranks = {r["rank"]: r for r in d["ranks"]}
    assert ranks[behind]["collective"]["op"] == "broadcast"
    assert ranks[ahead]["collective"]["op"] == "all_reduce"


def test_a_remote_rank_in_a_recv_is_seen_with_its_peer(fixtures, tmp_path):
    """Two nodes × 3 ranks (fixtures/recv_two_nodes_jobs, fuzz seed 90210 job 1, under watch):
    ranks 3-5 each recv from the rank before, under `if RANK > 0`, and rank 2 never sends;
    ranks 0-2 wait in the next all-reduce. The analysing node holds ranks 0-2; ranks 3-5 come
    from the other node's capture summary, which now carries the send/recv its probe sampled
    each rank inside (gloo's recorder has no entry for it). Without it that node's ranks were
    'idle', the round's verdict 'all wait in matching collectives' (uncertain), and the job
    was watched on until the fuzz run timed out."""
    from moe_hang.analysis.rules import diagnose
    from moe_hang.commands.multinode.summaries import capture_summary, merge_remote
    from moe_hang.probe.layout import RunLayout

    run = relocated(fixtures / "recv_two_nodes", tmp_path / "run",
                    "/work/main/runs/fuzz-90210/jobs", str(fixtures / "recv_two_nodes_jobs"))
    there = capture_summary(RunLayout(run / "node0"), "1", "vm", moving=None, alive=None)
    assert {r.rank: (r.p2p or {}).get("peer") for r in there.ranks} == {3: 2, 4: 3, 5: 4}
    ev = load_capture(run / "node1", world=6)
    merge_remote(ev, {"1": there})
    d = diagnose(ev).to_dict()
    assert (d["verdict"], d["culprit_ranks"]) == ("desync", [2]), d["summary"]
    assert d["fix"].startswith("Rank 3's recv(src=2) at "), d["fix"]
    assert "post the matching send(dst=3) on rank 2" in d["fix"]


@pytest.mark.parametrize("name, extra", [("extra_eval_stacks_2", 2), ("extra_eval_stacks_1", 1)])
def test_stacks_alone_a_rank_behind_inside_its_own_branch_posted_the_extra(
        fixtures, tmp_path, name, extra):
    """FSDP2 + experts, 4 ranks, under diagnose without a probe (fixtures/extra_eval_stacks_jobs,
    fuzz seed 90210 job 63, and its mirror): one rank runs `evaluate()` (an all-reduce) under
    `if FAULTY and step == FAULT_STEP:`, the others went on to the logger's all-gather. The
    evaluating rank is behind the others in program order only because it is inside a branch
    they did not take: it is the culprit, not the three that "went past" (was: ranks 0, 1, 3
    named by program order)."""
    run = relocated(fixtures / name, tmp_path / "run", "/tmp/fz90b/jobs",
                    str(fixtures / "extra_eval_stacks_jobs"))
    d = _diag(run)
    assert (d["verdict"], d["culprit_ranks"]) == ("desync", [extra]), d["summary"]
    assert d["fix"].startswith(f"Rank {extra} took `if FAULTY and step == FAULT_STEP`"), d["fix"]
    assert ":40 evaluate" in d["fix"] and ":91 <module>" in d["fix"]


@pytest.mark.parametrize("name, extra", [("extra_eval_end_stacks_6", 6),
                                         ("extra_eval_end_stacks_4", 4)])
def test_stacks_alone_a_rank_ahead_inside_its_own_branch_posted_the_extra(
        fixtures, tmp_path, name, extra):
    """FSDP2, 8 ranks, under diagnose without a probe (fixtures/extra_eval_end_jobs, fuzz
    seed 7130418 job 2, and its mirror): one rank runs `evaluate()` (an all-reduce, :40) under
    `if FAULTY and step == FAULT_STEP:` at the end of the step (:87); the others went on to
    the next step's forward, whose FSDP all-gather (:56) waits for it. The evaluating rank is
    ahead in program order and inside a branch only it took: the branch is the advice, not
    FSDP's "call the same modules ... on a dummy input" (was: the culprit right, the advice
    that of a module skip)."""
    run = relocated(fixtures / name, tmp_path / "run", "/work/main/runs/fuzz-7130418/jobs",
                    str(fixtures / "extra_eval_end_jobs"))
    d = _diag(run)
    # one of eight: the majority rung names it before the source's; the advice is the branch
    assert (d["verdict"], d["culprit_ranks"], d["culprit_basis"]) == (
        "desync", [extra], "majority"), d["summary"]
    assert d["fix"].startswith(f"Rank {extra} took `if FAULTY and step == FAULT_STEP`"), d["fix"]
    assert ":40 evaluate" in d["fix"] and ":56 Net.forward" in d["fix"], d["fix"]
    assert "dummy" not in d["fix"]


@pytest.mark.parametrize("name, skipper, here, there", [
    ("skip_step_two_nodes_3", 3, "node1", "node0"), ("skip_step_two_nodes_7", 7, "node0", "node1")])
def test_a_rank_past_the_training_loop_gets_loop_advice_not_dummy_input(
        fixtures, tmp_path, name, skipper, here, there):
    """FSDP2, two nodes × 4 ranks under watch (fixtures/skip_step_two_nodes_jobs, fuzz seed
    90210 job 75, and its mirror): one rank `continue`s past a whole step, so it is one
    step's all-gathers short and reaches the final barrier while the others all-gather in the
    last step's forward. It called no module the others called in a different order: it left
    the loop. The advice says so (was: "run a skipped block on an empty or dummy input")."""
    from moe_hang.commands.multinode.summaries import capture_summary, merge_remote
    from moe_hang.probe.layout import RunLayout

    run = relocated(fixtures / name, tmp_path / "run", "/tmp/fz90b/jobs",
                    str(fixtures / "skip_step_two_nodes_jobs"))
    remote = capture_summary(RunLayout(run / there), "1", "vm", moving=None, alive=None)
    ev = load_capture(run / here, world=8)
    merge_remote(ev, {"1": remote})
    d = diagnose(ev).to_dict()
    assert (d["verdict"], d["culprit_ranks"]) == ("desync", [skipper]), d["summary"]
    fix = d["fix"]
    assert fix.startswith(f"Rank {skipper} left the loop at "), fix
    assert "_skip_fsdp2.py:63 while" in fix and "dummy input" not in fix


@pytest.mark.parametrize("name, finisher", [("finishing_two_nodes_0", 0),
                                            ("finishing_two_nodes_1", 1)])
def test_a_rank_that_finished_after_posting_what_its_peer_waits_in_did_not_leave_it(
        fixtures, tmp_path, name, finisher):
    """DDP on two nodes × 1 rank, healthy, one rank slower for a while (fixtures/
    finishing_two_nodes_jobs, fuzz seed 90210 job 69, and its mirror): the faster rank
    finished and is in its interpreter's exit while the other's last beat still shows it in
    all-reduce #13. The finisher's exit beat counts 18 collectives posted on that group: it
    left nobody waiting, the other is only slower out of the last ones — healthy, not
    rank_died (which ended a healthy job)."""
    from moe_hang.evidence.load import load_captures

    run = relocated(fixtures / name, tmp_path / "run", "/tmp/fz69/jobs",
                    str(fixtures / "finishing_two_nodes_jobs"))
    d = diagnose(load_captures([run / "node0", run / "node1"])).to_dict()
    assert (d["verdict"], d["culprit_ranks"]) == ("healthy", []), d["summary"]
    assert d["summary"].startswith(f"Rank {finisher} finished after posting every collective "
                                   f"rank {1 - finisher} waits in (default_pg #13)"), d["summary"]


@pytest.mark.parametrize("name, leaver", [("left_in_exit_two_nodes_5", 5),
                                          ("left_in_exit_two_nodes_1", 1)])
def test_a_rank_in_its_exit_short_of_what_the_others_wait_in_has_left(
        fixtures, tmp_path, name, leaver):
    """A 2x2x2 mesh on two nodes × 4 ranks (fixtures/left_in_exit_jobs, fuzz seed 20261202
    job 66, and its mirror): one rank runs out of data and leaves (destroy_process_group,
    exit) while the others wait in the next all-reduce. Captured in its interpreter's exit it
    is still alive and its saved recorder is older than its end; its exit beat counts 6
    collectives on the default group, where the others wait in the 7th: it left them (was:
    "no rank raised an error of its own", culprit none)."""
    from moe_hang.evidence.load import load_captures

    run = relocated(fixtures / name, tmp_path / "run", "/tmp/fz66/jobs",
                    str(fixtures / "left_in_exit_jobs"))
    d = diagnose(load_captures([run / "node0", run / "node1"])).to_dict()
    assert (d["verdict"], d["culprit_ranks"]) == ("rank_died", [leaver]), d["summary"]
    assert d["summary"].startswith(f"Rank {leaver} exited (its interpreter shut down normally)")
    assert {r["rank"]: r["state"] for r in d["ranks"]}[leaver] == "exited"
    assert "DistributedSampler" in d["fix"]


@pytest.mark.parametrize("name, culprit", [("dtype_abort_no_frames_1", 1),
                                           ("dtype_abort_no_frames_2", 2)])
def test_a_rank_whose_line_is_unknown_is_no_camp_in_a_size_abort(
        fixtures, tmp_path, name, culprit):
    """Three ranks, the culprit's all-reduce in Double (fixtures/dtype_abort_no_frames_jobs,
    fuzz seed 5550123 job 43, and its mirror): gloo aborts a Float rank (it received 8 bytes
    where it expected 4); the recorders carry no call-site frames (no torch._dynamo), and a
    SIGTERMed survivor's stack may lack its main thread. A rank whose line is not known is
    no camp by line of its own: the byte counts decide (was: that rank, alone "at another
    line", named the culprit by majority)."""
    run = relocated(fixtures / name, tmp_path / "run", "/work/main/runs/fuzz-5550123/jobs",
                    str(fixtures / "dtype_abort_no_frames_jobs"))
    d = _diag(run)
    assert (d["verdict"], d["culprit_ranks"]) == ("desync", [culprit]), d["summary"]
    assert "Double" in d["fix"] and "Float" in d["fix"] and "dtype" in d["fix"], d["fix"]


@pytest.mark.parametrize("name, culprit", [("size_abort_uncounted_group_1", 1),
                                           ("size_abort_uncounted_group_0", 0)])
def test_an_aborted_rank_is_placed_in_a_group_its_last_beat_did_not_count(
        fixtures, tmp_path, name, culprit):
    """Two ranks, a logger group beside the default one (fixtures/size_abort_uncounted_group_
    jobs, fuzz seed 5550123 job 53, and its mirror): at step 3 the culprit all-gathers 5 rows
    on the logger group where it gathered 3 before; gloo aborts the other rank, whose last
    beat came before its first collective on that group and whose saved recorder is empty.
    Its stack (all_gather at :60) is placed at the survivor's open all-gather there, from the
    group's start, and the shape history names the rank that changed (was: "never posted
    it", culprit the aborted rank, "the evidence does not decide")."""
    run = relocated(fixtures / name, tmp_path / "run", "/work/main/runs/fuzz-5550123/jobs",
                    str(fixtures / "size_abort_uncounted_group_jobs"))
    d = _diag(run)
    assert (d["verdict"], d["culprit_ranks"]) == ("desync", [culprit]), d["summary"]
    assert d["first_divergence"]["kind"] == "size_mismatch"
    assert "pad to a common size" in d["fix"]


@pytest.mark.parametrize("name, skipper", [("fsdp2_skip_block_abort_1", 1),
                                           ("fsdp2_skip_block_abort_0", 0)])
def test_two_ranks_the_aborted_one_past_the_others_run_lacks_their_collective(
        fixtures, tmp_path, name, skipper):
    """FSDP2, two ranks (fixtures/fsdp2_skip_block_abort_jobs, fuzz seed 5550123 job 71, and
    its mirror): the skipper leaves block 0 out, so its blocks' all-gathers pair with the
    other's earlier blocks (same sizes) until its head's meets the other's last block, where
    gloo aborts it. Named as the one past what the other waits in (program order, no
    majority of two), it lacks the other's block all-gather: that line is the one shown, and
    its own head all-gather is not the divergence (was: its line :54 at the divergence)."""
    run = relocated(fixtures / name, tmp_path / "run", "/work/main/runs/fuzz-5550123/jobs",
                    str(fixtures / "fsdp2_skip_block_abort_jobs"))
    d = _diag(run)
    assert (d["verdict"], d["culprit_ranks"]) == ("desync", [skipper]), d["summary"]
    per = d["first_divergence"]["per_rank"]
    assert per[str(skipper)] is None and per[str(1 - skipper)]["callsite"]["line"] == 53
    assert f"rank {skipper} never posted it" in d["summary"]


@pytest.mark.parametrize("name, skipper", [("fsdp2_skip_broadcast_3", 3),
                                           ("fsdp2_skip_broadcast_2", 2)])
def test_a_skipped_broadcast_in_an_fsdp_job_gets_no_module_advice(
        fixtures, tmp_path, name, skipper):
    """FSDP2, four ranks (fixtures/fsdp2_skip_broadcast_jobs, fuzz seed 5550123 job 88, and
    its mirror): one rank skips the step's stop broadcast (`if not (FAULTY and ...)`) and
    goes on into the next forward's all-gathers. What it lacks is a broadcast its waiters'
    line calls itself, not a module FSDP gathers: no "dummy input" advice."""
    run = relocated(fixtures / name, tmp_path / "run", "/work/main/runs/fuzz-5550123/jobs",
                    str(fixtures / "fsdp2_skip_broadcast_jobs"))
    d = _diag(run)
    assert (d["verdict"], d["culprit_ranks"]) == ("desync", [skipper]), d["summary"]
    assert "dummy input" not in d["fix"] and ":79 <module>" in d["fix"], d["fix"]


@pytest.mark.parametrize("name, culprit", [("op_swap_named_group_0", 4),
                                           ("op_swap_named_group_1", 3)])
def test_stacks_alone_count_ranks_on_one_group_the_module_names_once(
        fixtures, tmp_path, name, culprit):
    """FSDP2 on 6 ranks under diagnose, no probe, a busy neighbour (fuzz seed 58213907 job
    18, and its mirror): one rank takes `if FAULTY and step == FAULT_STEP:` into
    `dist.barrier(group=LOG)` (:79) while five wait in `all_gather_into_tensor(...,
    group=LOG)` (:81). Both lines pass LOG, which the module assigns once: one group, so
    the lone rank is the minority (was: "the evidence does not decide", all six named)."""
    run = relocated(fixtures / name, tmp_path / "run",
                    "/work/wt-fuzz/runs/fuzz-58213907/jobs", str(fixtures / "fuzz58213907_jobs"))
    ev = captured(load_capture(run))
    job = str(fixtures / "fuzz58213907_jobs" / "fuzz58213907_018_op_swap_fsdp2.py")
    assert ev.source is not None and ev.source.line(job, 79).group == "LOG"
    d = diagnose(ev).to_dict()
    assert (d["verdict"], d["culprit_ranks"], d["culprit_basis"]) == (
        "desync", [culprit], "majority"), d["summary"]
    assert d["fix"].startswith(f"Rank {culprit} took `if FAULTY and step == FAULT_STEP`")


@pytest.mark.parametrize("name, culprit", [("mesh_lock_subgroup_0", 3),
                                           ("mesh_lock_subgroup_1", 0)])
def test_stacks_alone_ranks_past_a_subgroup_collective_wait_for_a_rank_at_a_lock(
        fixtures, tmp_path, name, culprit):
    """A 2x2 mesh under diagnose, no probe, a busy neighbour (fuzz seed 58213907 job 24, and
    its mirror): one rank deadlocks on a thread lock before its tp all-reduce (:74). Its tp
    peer waits there; the other tp pair completed their own tp all-reduce and wait in the
    dp all-reduce (:77). A rank waiting outside every collective holds up a subgroup's
    collective as one still computing does: a hang at the lock (was: a desync blaming the
    pair at :77, "make every rank post it, on the same group")."""
    run = relocated(fixtures / name, tmp_path / "run",
                    "/work/wt-fuzz/runs/fuzz-58213907/jobs", str(fixtures / "fuzz58213907_jobs"))
    d = diagnose(captured(load_capture(run))).to_dict()
    assert (d["verdict"], d["culprit_ranks"], d["culprit_basis"]) == (
        "hang", [culprit], "waited_for"), d["summary"]
    assert ":58 checkpoint_state" in d["fix"] and "same group" not in d["fix"]


@pytest.mark.parametrize("name, extra", [("thread_extra_two_ranks_0", 0),
                                         ("thread_extra_two_ranks_1", 1)])
def test_a_metrics_thread_with_one_more_on_two_ranks_is_named_by_its_rate(
        fixtures, tmp_path, name, extra):
    """Two ranks, a metrics thread each on a group of its own (fuzz seed 58213907 job 33,
    and its mirror): one rank queues one more tensor, its thread waits in that all-reduce;
    the other's thread ended, its main thread left the loop for the final barrier. No
    majority on two ranks, and every all-reduce of the thread looks alike; what decides is
    the rate: each thread's j-th all-reduce came within a lap of the main loop's j-th on both
    ranks, and the extra rank's thread posted 6 for 5 laps (was: both named, "which one, this
    capture does not decide"; before that "history" from the final barrier, the wrong rank).
    Never "opposite orders"."""
    run = relocated(fixtures / name, tmp_path / "run",
                    "/work/wt-fuzz/runs/fuzz-58213907/jobs", str(fixtures / "fuzz58213907_jobs"))
    d = diagnose(captured(load_capture(run))).to_dict()
    assert (d["verdict"], d["culprit_ranks"], d["culprit_basis"]) == (
        "desync", [extra], "history"), d["summary"]
    assert d["fix"].startswith(f"Rank {extra}'s thread that posts the all_reduce on group 2 "
                               "at "), d["fix"]
    assert ":53 log_metrics posted 6 for its main loop's 5 laps" in d["fix"], d["fix"]
    assert "(one more)" in d["fix"] and "opposite orders" not in d["fix"]
    fd = d["first_divergence"]  # the thread's group, where the counts part
    other = 1 - extra
    assert fd["per_rank"][str(extra)]["callsite"]["line"] == 53 and fd["per_rank"][str(other)] \
        is None, fd


@pytest.mark.parametrize("name, culprit", [("metrics_thread_guard_0", 1),
                                           ("metrics_thread_guard_1", 0)])
def test_a_metrics_thread_that_skips_under_a_guard_on_its_rank_is_the_culprit(
        fixtures, tmp_path, name, culprit):
    """The corpus's `metrics_thread` on two ranks, both roles: the culprit's thread takes
    `if rank == culprit and step == 3: continue` before its all-reduce, so its thread ends
    with one post fewer; the other's waits in its last one. One rank against one: the rate
    decides (one all-reduce per lap on both ranks, the culprit's thread ended one short),
    and the guard, the all-reduce's rank condition, gives the advice (was decided by
    "history" from the final barrier, the reading that blamed the wrong rank of fuzz 58213907
    job 33)."""
    run = relocated(fixtures / name, tmp_path / "run", "/work/wt-corpus/tests/corpus/jobs",
                    str(ROOT / "tests" / "corpus" / "jobs"))
    d = diagnose(captured(load_capture(run))).to_dict()
    assert (d["verdict"], d["culprit_ranks"], d["culprit_basis"]) == (
        "desync", [culprit], "history"), d["summary"]
    assert d["fix"].startswith(f"Rank {culprit} does not take `if not (rank == culprit and "
                               "step == 3)`"), d["fix"]


@pytest.mark.parametrize("name, culprit", [("stacks_order_swap_mesh2d_0", 0),
                                           ("stacks_order_swap_mesh2d_1", 3),
                                           ("stacks_order_swap_fsdp2_moe_0", 3),
                                           ("stacks_order_swap_fsdp2_moe_1", 4)])
def test_stacks_alone_a_rank_on_a_group_of_every_rank_is_counted_against_the_rest(
        fixtures, tmp_path, name, culprit):
    """Stacks alone (diagnose, fuzz seed 61120905 jobs 55 and 25, both roles): one rank
    all-gathers on ``LOG = dist.new_group(list(range(WORLD)))`` while the others all-reduce
    on the default group (it posted the two in the other order). Both groups span every
    rank, so every rank owes both: the lone rank is the minority (was: "counting ranks
    across groups says nothing", every rank named)."""
    run = relocated(fixtures / name, tmp_path / "run", "/work/wt-f/runs/fuzz-61120905/jobs",
                    str(fixtures / "fuzz61120905_jobs"))
    ev = captured(load_capture(run))
    job = next(iter(ev.source.files)) if ev.source is not None else ""
    assert any(lf.group == "LOG" and lf.every_rank for lf in ev.source.files[job].values())
    d = diagnose(ev).to_dict()
    assert (d["verdict"], d["culprit_ranks"], d["culprit_basis"]) == (
        "desync", [culprit], "majority"), d["summary"]
    assert d["fix"].startswith(f"Rank {culprit} took `if FAULTY and step == FAULT_STEP`")


@pytest.mark.parametrize("name, culprit, waiting", [("stacks_async_wait_0", 0, [1, 2, 3, 4, 5]),
                                                    ("stacks_async_wait_1", 2, [0, 1, 3, 4, 5])])
def test_stacks_alone_ranks_in_work_wait_wait_on_collectives_they_posted_earlier(
        fixtures, tmp_path, name, culprit, waiting):
    """Stacks alone, a 3x2 mesh, both roles (fuzz seed 11 job 19): every step posts three
    all-reduces with ``async_op=True`` and waits on them in ``for work in pending:
    work.wait()``; the culprit skips one and goes on to the final barrier. The others' stacks
    show the wait, and nothing names the line that posted what they wait on: the advice says
    they wait there on collectives posted earlier (was: "posted theirs at" the wait's line)."""
    run = relocated(fixtures / name, tmp_path / "run", "/work/main/runs/fuzz-11/jobs",
                    str(fixtures / "fuzz11_jobs"))
    d = diagnose(captured(load_capture(run))).to_dict()
    assert (d["verdict"], d["culprit_ranks"], d["culprit_basis"]) == (
        "desync", [culprit], "majority"), d["summary"]
    r = {x["rank"]: x for x in d["ranks"]}
    assert r[culprit]["callsite"]["line"] == 61
    assert {r[w]["callsite"]["line"] for w in waiting} == {60}
    assert f"{who(waiting)} wait at " in d["fix"] and "on collectives they posted earlier" \
        in d["fix"] and "posted theirs" not in d["fix"], d["fix"]
    assert f"{who(waiting)} wait on collectives they posted earlier" in d["summary"], \
        d["summary"]


@pytest.mark.parametrize("name, culprit, tp_peer", [("silent_mesh_tp_0", 3, 2),
                                                    ("silent_mesh_tp_1", 1, 0)])
def test_a_rank_waiting_later_in_a_diverged_group_is_held_up_not_a_culprit(
        fixtures, tmp_path, name, culprit, tp_peer):
    """A 2x2 mesh under watch, both roles (fuzz seed 90417733 job 5): the culprit skips the
    step's `acc` all-reduce (default group, seq 5); its `loss` all-reduce pairs silently
    with the others' `acc`, and it goes on to the next step's tp all-reduce, where its tp
    peer never comes: the peer waits in the default group's seq 6, past the divergence at
    seq 5. Held up there, it is no culprit of the tp group's divergence (was: both named)."""
    run = relocated(fixtures / name, tmp_path / "run", "/work/wt-fz/runs/fuzz-90417733/jobs",
                    str(fixtures / "fuzz90417733_jobs"))
    d = diagnose(captured(load_capture(run))).to_dict()
    assert (d["verdict"], d["culprit_ranks"], d["culprit_basis"]) == (
        "desync", [culprit], "history"), d["summary"]
    assert "more group(s) diverged" not in d["summary"], d["summary"]
    r = {x["rank"]: x for x in d["ranks"]}
    assert (r[tp_peer]["collective"]["pg"], r[tp_peer]["collective"]["seq"]) == ("0", 6)


@pytest.mark.parametrize("name, culprit, tp_peer", [("stacks_eval_mesh_0", 2, 3),
                                                    ("stacks_eval_mesh_1", 3, 2)])
def test_stacks_alone_one_rank_in_a_branch_of_its_own_against_three_lines(
        fixtures, tmp_path, name, culprit, tp_peer):
    """Stacks alone, a 2x2 mesh, both roles (fuzz seed 90417733 job 30): the culprit alone
    runs an evaluation's all-reduce on the default group under `if FAULTY and step ==
    FAULT_STEP`; its tp peer waits in the next step's tp all-reduce (:54), the other two in
    their dp all-reduces (:57). Three camps, one op at three lines: the culprit's camp is
    behind every other on a collective every rank owes (default group), so it is counted
    against all the rest (its extra, or their skip: one rank against three). Was: the
    three others named ("they went past what the others wait in"); then a source-only
    reading for this case, since subsumed by the count (the advice still names its branch)."""
    run = relocated(fixtures / name, tmp_path / "run", "/work/wt-fz/runs/fuzz-90417733/jobs",
                    str(fixtures / "fuzz90417733_jobs"))
    d = diagnose(captured(load_capture(run))).to_dict()
    assert (d["verdict"], d["culprit_ranks"], d["culprit_basis"]) == (
        "desync", [culprit], "majority"), d["summary"]
    r = {x["rank"]: x for x in d["ranks"]}
    assert (r[culprit]["callsite"]["line"], r[tp_peer]["callsite"]["line"]) == (40, 54)
    assert d["fix"].startswith(f"Rank {culprit} took `if FAULTY and step == FAULT_STEP`"), \
        d["fix"]


@pytest.mark.parametrize("name, culprit, past", [("extra_p2p_past_0", 1, 2),
                                                 ("extra_p2p_past_1", 2, 1)])
def test_a_rank_past_its_side_of_the_divergence_is_shown_where_it_is(
        fixtures, tmp_path, name, culprit, past):
    """A 3-stage pipeline under watch (fuzz seed 61120905 job 35, both roles): the culprit
    runs an evaluation's all-reduce against the others' broadcast at seq 8; the broadcast
    reached one receiving stage, which went on to the next step's recv (its recorder has the
    broadcast done). That rank is in the recv at its line, not at the broadcast (was: the
    broadcast's line, and "wait at" it in the advice)."""
    run = relocated(fixtures / name, tmp_path / "run", "/work/wt-f/runs/fuzz-61120905/jobs",
                    str(fixtures / "fuzz61120905_jobs"))
    d = diagnose(captured(load_capture(run))).to_dict()
    assert (d["verdict"], d["culprit_ranks"]) == ("desync", [culprit]), d["summary"]
    r = {x["rank"]: x for x in d["ranks"]}
    assert (r[past]["collective"]["op"], r[past]["callsite"]["line"]) == ("recv", 52), r[past]
    assert r[0]["callsite"]["line"] == 66 and r[culprit]["callsite"]["line"] == 39
    assert f"rank {past} at " in d["fix"] and ":52 <module>" in d["fix"], d["fix"]


@pytest.mark.parametrize("name, culprit", [("fsdp_eval_abort_pending_0", 2),
                                           ("fsdp_eval_abort_pending_1", 0)])
def test_a_rank_with_two_all_gathers_pending_is_at_the_one_its_stack_is_in(
        fixtures, tmp_path, name, culprit):
    """FSDP2 MoE, 4 ranks, one rank's evaluation forward pairs silently until gloo aborts
    (fuzz seed 61120905 job 50, both roles). A rank ended by the teardown has two all-gathers
    pending: the forward's head (:70), still in flight, and the backward's (:86), whose call
    its last stack is inside. Its line is :86, where it is (was: :70, the older one)."""
    run = relocated(fixtures / name, tmp_path / "run", "/work/wt-f/runs/fuzz-61120905/jobs",
                    str(fixtures / "fuzz61120905_jobs"))
    d = diagnose(captured(load_capture(run))).to_dict()
    assert (d["verdict"], d["culprit_ranks"]) == ("desync", [culprit]), d["summary"]
    lines = {x["rank"]: x["callsite"]["line"] for x in d["ranks"]}
    assert lines == {r: 62 if r == culprit else 86 for r in range(4)}, lines
    assert "never post:" in d["fix"], d["fix"]  # three ranks: "never post", not "posts"


@pytest.mark.parametrize("name, culprit", [("stacks_silent_extra_fsdp_0", 1),
                                           ("stacks_silent_extra_fsdp_1", 3)])
def test_stacks_alone_a_rank_behind_the_forward_is_not_told_it_skipped_a_module(
        fixtures, tmp_path, name, culprit):
    """FSDP2 MoE, 6 ranks, stacks alone (diagnose; fuzz seed 73920461 job 41, both roles):
    the culprit posts one more all-reduce of the same size, which gloo pairs silently; it
    ends in the next step's all-reduce (:75) while the others are in the forward's FSDP
    all-gather (:52). It never got to the forward: nothing was skipped there (was: "did not
    call the one ... run a skipped block on an empty or dummy input")."""
    run = relocated(fixtures / name, tmp_path / "run", "/work/wt-f2/runs/fuzz-73920461/jobs",
                    str(fixtures / "fuzz73920461_jobs"))
    d = diagnose(captured(load_capture(run))).to_dict()
    assert (d["verdict"], d["culprit_ranks"], d["culprit_basis"]) == (
        "desync", [culprit], "majority"), d["summary"]
    assert d["fix"].startswith(f"Rank {culprit} is still in the all_reduce at "), d["fix"]
    assert "dummy input" not in d["fix"] and "posted one more" in d["fix"]


@pytest.mark.parametrize("name, culprit", [("async_before_fsdp_0", 0), ("async_before_fsdp_1", 1)])
def test_a_rank_behind_its_own_async_post_is_at_that_post_not_the_fsdp_call(
        fixtures, tmp_path, name, culprit):
    """FSDP2, 3 ranks, async all-reduces waited at the step's end (fuzz seed 73920461 job 54,
    both roles): the culprit's extra pairs silently; its next step's ``ntok`` all-reduce,
    posted with ``async_op=True`` at :70, never completes, and its stack is in the forward's
    FSDP all-gather (:49), queued behind it on the same group. Its line is :70, the oldest
    pending (an FSDP unshard before the stack's call would have been waited already; a
    user's async post need not be)."""
    run = relocated(fixtures / name, tmp_path / "run", "/work/wt-f2/runs/fuzz-73920461/jobs",
                    str(fixtures / "fuzz73920461_jobs"))
    d = diagnose(captured(load_capture(run))).to_dict()
    assert (d["verdict"], d["culprit_ranks"]) == ("desync", [culprit]), d["summary"]
    r = {x["rank"]: x for x in d["ranks"]}
    assert (r[culprit]["collective"]["op"], r[culprit]["callsite"]["line"]) == ("all_reduce", 70)
    assert all(r[o]["callsite"]["line"] == 49 for o in r if o != culprit), r


@pytest.mark.parametrize("name, stale", [("stale_stack_at_exit_0", 0),
                                         ("stale_stack_at_exit_1", 1)])
def test_an_exit_beat_is_newer_than_a_stack_that_shows_the_program_running(
        fixtures, tmp_path, name, stale):
    """pause_once.py under watch on two busy cores (fixtures/stale_stack_at_exit_*, recorded
    by watch itself in watched/1/, both roles): one rank pauses 10.6 s, the stall is captured
    as it resumes. py-spy caught rank ``stale`` in the all-reduce; by the time its probe was
    asked for a dump it was in its interpreter's exit, its last beat counting every
    collective posted and completed (8 of 8), as the other rank's did. A stack whose main
    thread is still at a module's top level was sampled before that exit: both finished.
    Was, with the pausing rank 1: "Rank 1 exited ... before the others while rank 0 in
    all_reduce waited for it", rank_died, definite — which ends a job that is finishing."""
    run = relocated(fixtures / name, tmp_path / "run", "/work/main/tests/e2e/jobs", str(JOBS))
    d = diagnose(load_capture(run)).to_dict()
    assert (d["verdict"], d["culprit_ranks"]) == ("healthy", []), d["summary"]
    r = {x["rank"]: x for x in d["ranks"]}
    assert r[stale]["state"] == "exited" and r[1 - stale]["state"] == "exited"


@pytest.mark.parametrize("name, extra", [("count_shift_0", 0), ("count_shift_1", 1)])
def test_ranks_past_an_unconditional_line_posted_it_themselves_one_more_is_an_extra(
        fixtures, tmp_path, name, extra):
    """A 2x3 mesh, 6 ranks on two busy cores under watch (fixtures/count_shift_jobs, fuzz
    seed 19283746 job 9, and its mirror): at step 2 one rank also all-reduces a gradient
    norm on the default group, which gloo pairs silently with the others' next step's first
    all-reduce (one float each). No probe answered the dump request: the recorders are the
    periodic saves, without call sites. The ranks then meet in a cycle: the extra rank waits
    in default #11 at the loop's first line, the others are past that line in the same pass
    (in tp/dp all-reduces) having posted its all-reduce as #10. Nothing lets a rank through
    that line without posting it: they skipped nothing there; the one rank with one more is
    the culprit (5 against 1). Was: "ranks 1-3, 5 went past what rank 0 waits in", definite,
    both roles."""
    run = relocated(fixtures / name, tmp_path / "run", "/work/wt-f/runs/fuzz-19283746/jobs",
                    str(fixtures / "count_shift_jobs"))
    d = diagnose(load_capture(run)).to_dict()
    assert (d["verdict"], d["culprit_ranks"], d["certainty"], d["culprit_basis"]) == (
        "desync", [extra], "likely", "majority"), d["summary"]
    assert f"rank {extra} posted more collectives on default_pg before it" in d["summary"]
    assert d["fix_site"]["line"] == 59  # the loop's one default-group call under a branch
    assert "posting its collective as default_pg#10 at the latest" in d["summary"]
    assert d["fix"].startswith(f"Rank {extra} posted more collectives on default_pg than")


@pytest.mark.parametrize("name, extra, rule", [("count_shift_p2p_0", 0, "cycle"),
                                               ("count_shift_p2p_2", 2, "desync")])
def test_a_count_shift_decides_a_desync_as_it_does_a_cycle(fixtures, tmp_path, name, extra,
                                                           rule):
    """An 8-stage send/recv pipeline under watch (fixtures/count_shift_jobs, fuzz seed
    74125896 job 4, and its mirror): at step 2 one stage also all-reduces one float, which
    pairs silently with the next step's first. The captures are the recorded ones with the
    probe's answers taken out (as on the busy machine where the miss was seen: only the
    periodic saves, without call sites). Mirrored, rank 0 (the first stage, past its send,
    in the accuracy all-reduce at line 52) and rank 2 (the token all-reduce, 43) both wait
    in default_pg#11: line order read rank 0 as past what rank 2 waits in, and blamed it.
    But every rank went through line 43 in this pass (nothing lets a pass by it) posting
    it as #10 at the latest, where rank 2 waits in it as #11: the counts decide a desync as
    they decide a cycle (7 against 1), and a rank further along a line it posted itself
    skipped nothing there."""
    run = relocated(fixtures / name, tmp_path / "run", "/tmp/f74/jobs",
                    str(fixtures / "count_shift_jobs"))
    d = diagnose(load_capture(run)).to_dict()
    assert (d["verdict"], d["culprit_ranks"], d["culprit_basis"], d["rule_id"]) == (
        "desync", [extra], "majority", rule), d["summary"]
    assert f"rank {extra} posted more collectives on default_pg before it" in d["summary"]
    assert d["fix"].startswith(f"Rank {extra} posted more collectives on default_pg than")
    assert d["fix_site"]["line"] == 57  # the loop's one default-group call under a branch


@pytest.mark.parametrize("name, killed", [("excepthook_stack_0", 2), ("excepthook_stack_1", 0)])
def test_a_rank_caught_in_its_excepthook_is_at_the_line_that_raised(
        fixtures, tmp_path, name, killed):
    """A 2x2 mesh on two nodes beside a busy neighbour (fixtures/excepthook_stack_jobs, fuzz
    seed 55173209 job 9, and its mirror): one rank is SIGKILLed, the others fail in the
    broadcast at line 61. py-spy caught one of them in its excepthook, the probe's dump
    waiting on its lock (contextlib's ``__enter__`` under moe-hang's own frames, no frame of
    the job's). That rank has raised: its line is the traceback's, 61 (was:
    ``contextlib.py:137``, the probe's own lock read as the job's line)."""
    from moe_hang.evidence.load import load_captures

    run = relocated(fixtures / name, tmp_path / "run", "/work/wt-f/runs/fuzz-55173209/jobs",
                    str(fixtures / "excepthook_stack_jobs"))
    d = diagnose(load_captures([run / "node0", run / "node1"])).to_dict()
    assert (d["verdict"], d["culprit_ranks"]) == ("rank_died", [killed]), d["summary"]
    sites = {r["rank"]: r["callsite"] or {} for r in d["ranks"]}
    assert all(sites[r].get("file", "").endswith("_sigkill_mesh2d.py") for r in range(4)), sites
    if name.endswith("_1"):  # the mirror: rank 3 was the one in its excepthook
        assert all(sites[r]["line"] == 61 for r in (1, 2, 3)), sites


def test_an_exit_beat_with_a_collective_left_pending_is_not_past_the_stack(fixtures, tmp_path):
    """The same capture, but the exit beat counts the all-reduce posted and not completed (a
    rank that caught the collective's failure and exited): its stack may be where it failed,
    so it is not taken as past it."""
    run = relocated(fixtures / "stale_stack_at_exit_0", tmp_path / "run",
                    "/work/main/tests/e2e/jobs", str(JOBS))
    hb_path = run / "ranks" / "rank0.hb.json"
    hb = json.loads(hb_path.read_text())
    hb["pg_status"]["0"]["completed"] = 7
    hb_path.write_text(json.dumps(hb))
    d = diagnose(load_capture(run)).to_dict()
    assert {r["rank"]: r["state"] for r in d["ranks"]}[0] == "in_collective", d["summary"]


@pytest.mark.parametrize("name, skipper", [("count_shift_lap_0", 1), ("count_shift_lap_1", 3)])
def test_a_rank_a_pass_on_posted_the_line_the_others_wait_in_it_skipped_another(
        fixtures, tmp_path, name, skipper):
    """A 4x2 mesh, 8 ranks under watch (fixtures/count_shift_jobs, fuzz seed 19283746 job 8,
    and its mirror): at step 3 one rank skips the accuracy all-reduce (under ``if not
    (FAULTY and step == FAULT_STEP)``), its loss all-reduce pairs with the others' accuracy
    one, and it goes on to the next step's tp all-reduce, where its partner never comes: the
    others wait in the loss all-reduce, default #8. It is a pass on (it waits in tp#5, its
    partner — past that line in its own pass — posted 4), so it went through the loss line
    of their pass and posted it: it did not skip what they wait in (was: "went past what rank
    0 waits in: make it post that too"); it posted fewer on the default group before it."""
    run = relocated(fixtures / name, tmp_path / "run", "/work/wt-f/runs/fuzz-19283746/jobs",
                    str(fixtures / "count_shift_jobs"))
    d = diagnose(load_capture(run)).to_dict()
    assert (d["verdict"], d["culprit_ranks"], d["culprit_basis"]) == (
        "desync", [skipper], "majority"), d["summary"]
    assert d["fix"].startswith(f"Rank {skipper} posted fewer collectives on default_pg than")
    assert "make it post that too" not in d["fix"]
    assert d["fix_site"]["line"] == 52  # the loop's one default-group call under a branch
