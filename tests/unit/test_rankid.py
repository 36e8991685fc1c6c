"""Ranks of unknown number (evidence.rankid) and a rank's identity from its frames: pure."""

from __future__ import annotations

from moe_hang.evidence import rankid
from moe_hang.evidence.rankid import identity_from_locals, relabel_json, relabel_text
from moe_hang.probe import launchers

A, B = rankid.unidentified_key(4242), rankid.unidentified_key(4243)  # consecutive pids


def test_sentences_name_an_unidentified_rank_by_its_pid():
    keys = {A, B}
    assert relabel_text(f"Rank {A} went past what rank 0 waits in", keys) == \
        "PID 4242 (unidentified rank) went past what rank 0 waits in"
    # a run of keys (consecutive pids) the way ranktext.spans writes it, and a mixed list
    assert relabel_text(f"ranks {B}-{A} wait", keys) == \
        "PIDs 4242, 4243 (unidentified ranks) wait"
    assert relabel_text(f"ranks 0, 1 and {A} wait", keys) == \
        "ranks 0, 1 and PID 4242 (unidentified rank) wait"
    assert relabel_text(f"waits for {A}'s send", keys) == \
        "waits for PID 4242 (unidentified rank)'s send"
    assert relabel_text("rank 3 at seq -1", keys) == "rank 3 at seq -1"  # nothing else moves


def test_the_json_keeps_no_number_for_an_unidentified_rank():
    d = {"culprit_ranks": [A], "summary": f"rank {A} skipped it",
         "ranks": [{"rank": A, "pid": 4242, "note": None}, {"rank": 0, "pid": 7}],
         "first_divergence": {"ranks": [0, A], "per_rank": {"0": {}, str(A): None}},
         "evidence": [f"rank {A}: py-spy failed"], "fix": ""}
    out = relabel_json(d)
    assert out["culprit_ranks"] == [] and out["culprit_pids"] == [4242]
    assert out["ranks"][0] == {"rank": None, "pid": 4242, "note": None, "unidentified": True}
    assert out["first_divergence"] == {"ranks": [0], "per_rank": {"0": {}, "pid:4242": None}}
    assert out["summary"] == "PID 4242 (unidentified rank) skipped it"
    assert out["evidence"] == ["PID 4242 (unidentified rank): py-spy failed"]
    plain = {"culprit_ranks": [1], "ranks": [{"rank": 1, "pid": 9}]}
    assert relabel_json(plain) is plain  # no unidentified rank: untouched, no new field


def _frames(*frames: tuple[str, str, dict[str, str]]) -> list[dict]:
    return [{"os_thread_id": 10, "frames": [
        {"name": n, "filename": f, "locals": [{"name": k, "repr": v} for k, v in loc.items()]}
        for n, f, loc in frames]}]


def test_identity_from_the_jobs_own_frames():
    tutorial = _frames(("train", "/job/train.py", {"model": "<DDP>"}),
                       ("main", "/job/train.py", {"rank": "1", "world_size": "2"}),
                       ("_wrap", "/venv/site-packages/torch/multiprocessing/spawn.py",
                        {"i": "1", "rank": "7"}))  # library frames do not count
    assert identity_from_locals(tutorial, 10) == (1, 2)
    in_init = _frames(("init_process_group",
                       "/venv/site-packages/torch/distributed/distributed_c10d.py",
                       {"rank": "3", "world_size": "4"}))
    assert identity_from_locals(in_init, 10) == (3, 4)
    # a local rank beside a global one: no guess
    assert identity_from_locals(_frames(("a", "/job/t.py", {"rank": "0"}),
                                        ("b", "/job/t.py", {"rank": "5"})), 10) == (None, None)
    assert identity_from_locals(_frames(("a", "/job/t.py", {"rank": "'0'"})), 10) == (None,
                                                                                      None)


def test_launcher_variables_are_read_one_launcher_at_a_time():
    # srun torchrun ...: the worker's global RANK, not its node's SLURM_PROCID
    both = {"RANK": "5", "WORLD_SIZE": "8", "SLURM_PROCID": "1", "SLURM_NTASKS": "2"}
    assert launchers.from_env(both) == launchers.EnvIdentity(5, 8, None, None, "torchrun")
    slurm = {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "1"}
    assert launchers.from_env(slurm) == launchers.EnvIdentity(1, 2, 1, None, "slurm")
    ompi = {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"}
    assert launchers.from_env(ompi).launcher == "openmpi"
    assert launchers.from_env({"PMI_RANK": "x"}) is None
