"""Ranks stuck making their process group (analysis/joining.py): recorded under ``moe-hang
watch`` (fixtures/joining_restart_job.py under ``torchrun --max-restarts 2``): the first
attempt's gloo abort, two restarts whose ranks could not connect, the last attempt's two
ranks both inside ``init_process_group``. It said "All 2 ranks wait in ? with matching order
and sizes"; no collective was ever posted in that attempt."""

from __future__ import annotations

from moe_hang.analysis.joining import making_group
from moe_hang.analysis.rules import diagnose
from moe_hang.evidence.load import load_capture
from moe_hang.evidence.stacks import Frame
from moe_hang.evidence.vocab import JobState

C10D = "/x/site-packages/torch/distributed/distributed_c10d.py"


def test_ranks_inside_init_process_group_are_said_to_be_forming_the_group(fixtures):
    d = diagnose(load_capture(fixtures / "joining_restart")).to_dict()
    assert (d["verdict"], d["culprit_ranks"], d["rule_id"]) == ("hang", [], "joining"), \
        d["summary"]
    # never ended by watch: a group slow to form (a peer still loading) looks the same
    assert d["certainty"] == "uncertain"
    assert d["summary"].startswith("All 2 ranks are inside init_process_group at "), \
        d["summary"]
    assert "the group never formed" in d["summary"] and " ? " not in d["summary"]
    assert "MASTER_ADDR" in d["fix"]


def test_without_the_stall_shown_it_is_not_called_a_hang(fixtures, tmp_path):
    """The same ranks caught by one snapshot (no watcher saw their heartbeats hold still):
    a group still forming looks just the same — inconclusive, said so."""
    import dataclasses

    ev = load_capture(fixtures / "joining_restart")
    ev = dataclasses.replace(ev, job=JobState.RUNNING)
    d = diagnose(ev).to_dict()
    assert (d["verdict"], d["rule_id"]) == ("inconclusive", "joining"), d["summary"]
    assert d["summary"].endswith("whether it is stuck or only slow to form.")


def test_a_group_is_being_made_only_inside_torchs_own_makers():
    assert making_group([Frame(C10D, 2169, "_new_process_group_helper"),
                         Frame(C10D, 1899, "init_process_group"),
                         Frame("/job/train.py", 8, "<module>")]) == "_new_process_group_helper"
    # a job's own function of that name is not torch making a group
    assert making_group([Frame("/job/train.py", 3, "new_group")]) is None
    assert making_group([Frame(C10D, 3252, "all_reduce")]) is None


def test_watch_says_where_the_ranks_wait_while_it_waits(fixtures):
    """Watch's line while it waits on an uncertain stall (it never ends one): with no culprit
    and no collective, where each rank is — not "waiting 10 s on the job"."""
    from moe_hang.commands.supervise import waiting_line

    line = waiting_line(diagnose(load_capture(fixtures / "joining_restart")), 10)
    assert line.startswith("waiting 10 s on ranks 0, 1 at "), line
    assert "restart_hang.py:8 <module>" in line, line  # as recorded
    assert line.endswith("(not ended: it may only be slow; still watching)")


def test_after_restarts_the_first_attempt_is_what_to_fix(fixtures):
    """The attempt stuck making its group is a restarted one (torchrun --max-restarts 2,
    whose restarted gloo ranks failed to connect or stalled here: measured 3 of 11 plain
    torchrun runs stalled, 8 failed with Connection refused): the verdict says so and points
    at the first attempt's failure — through ``analyze`` of the capture too (its loader
    kept no restarts)."""
    from moe_hang.evidence.load import load_captures

    for ev in (load_capture(fixtures / "joining_restart"),
               load_captures([fixtures / "joining_restart"])):
        assert ev.restarts is not None and ev.restarts.count == 2
        d = diagnose(ev).to_dict()
        assert "torchrun restarted the ranks: after 2 restarts; attempt 1: ranks 0, 1 failed " \
               "with communication errors" in d["summary"], d["summary"]
        assert d["fix"].startswith("torchrun restarted these ranks: what failed the first "
                                   "attempt is what to fix"), d["fix"]
        assert "--max-restarts 0 under `moe-hang watch`" in d["fix"]
