"""Two 8-rank meshes the fuzz generator wrote (seed 77163029, jobs 46 and 68, both roles),
wrong before on the counts each rank's recorder keeps per group.

- A 2x4 mesh on two nodes: a whole tp row posts its dp all-reduce on tp (the row completes
  it) and waits in the world all-reduce; each of the other row's ranks waits for its dp
  partner. Three of the row's four ranks were named: one rank's heartbeat counts are keyed by
  its recorder's own group ids, which count only the groups it belongs to (its id "2" is
  group "6", its tp), and id "2" was read as group "2" (the dp pair it never posted on), so
  its partner's wait had no edge. Now an id is a group name only through a record that holds
  both (``timeline.beat_names``).
- A 4x2 mesh beside a busy neighbour (no recorded stacks: no dump answered): one rank
  all-reduces an extra size-1 tensor over the world (paired silently with the others' loss)
  and waits in its own loss; its dp peers wait a pass on. It was read as the same pass with
  one dp all-reduce skipped ("a skip"): but there its world count would be two more than
  theirs, and it is one more — the same pass needs a second difference, a pass behind only
  the extra (``shift._counts_allow``). The divergence is where the extra met their loss,
  the source's one collective on the world under a branch (``shift.paired_at``)."""

from __future__ import annotations

import pytest

from moe_hang.analysis.rules import diagnose
from moe_hang.analysis.timeline import beat_names
from moe_hang.evidence.load import load_captures
from moe_hang.evidence.model import RankEvidence
from moe_hang.evidence.probe_records import Heartbeat


@pytest.mark.parametrize(("fixture", "row"), [
    ("mesh2d_row_wrong_group_4", [4, 5, 6, 7]), ("mesh2d_row_wrong_group_0", [0, 1, 2, 3])])
def test_every_rank_of_the_row_that_posted_on_tp(fixtures, fixture, row):
    d = diagnose(load_captures([fixtures / fixture / "node0", fixtures / fixture / "node1"]))
    assert (d.verdict, d.culprit_ranks) == ("desync", row), d.summary
    assert d.fix is not None and "passed mesh_tp to the all_reduce" in d.fix


def test_a_heartbeats_group_ids_are_named_by_the_records_that_hold_both():
    hb = Heartbeat.parse({"rank": 5, "pid": 1, "time": 0.0, "pg_status": {
        "0": {"enqueued": 5, "completed": 4}, "2": {"enqueued": 4, "completed": 4},
        "3": {"enqueued": 2, "completed": 2}}, "pending": [
            {"pg_id": 0, "process_group": ["0", "default_pg"]}]})
    assert hb is not None
    ev = RankEvidence(rank=5, pid=1, heartbeat=hb, log_pg_names={"2": "6"})
    # "3" is named nowhere, and this process does not number its groups as their names
    assert beat_names(ev, hb) == {"0": "0", "2": "6"}
    plain = RankEvidence(rank=0, pid=1, heartbeat=hb, log_pg_names={"2": "2"})
    assert beat_names(plain, hb) == {"0": "0", "2": "2", "3": "3"}


@pytest.mark.parametrize(("fixture", "extra", "partner"), [
    ("mesh2d_behind_extra_6", 6, 7), ("mesh2d_behind_extra_5", 5, 4)])
def test_a_pass_behind_after_an_extra_is_not_a_skip_in_the_same_pass(fixtures, fixture,
                                                                       extra, partner):
    d = diagnose(load_captures([fixtures / fixture])).to_dict()
    assert (d["verdict"], d["culprit_ranks"]) == ("desync", [extra]), d["summary"]
    assert "(an extra, paired silently" in d["summary"], d["summary"]
    assert "skip" not in d["summary"]
    assert d["fix"].startswith(f"Rank {extra} posted more collectives on default_pg"), d["fix"]
    assert d["fix"].endswith("silent_mesh2d.py:55 <module>."), d["fix"]
    fd = d["first_divergence"]
    assert (fd["pg"], fd["seq"], fd["kind"]) == ("0", 8, "extra_collective")
    lines = {int(r): c["callsite"]["line"] for r, c in fd["per_rank"].items()}
    dp_peers = [r for r in range(8) if r % 2 == extra % 2 and r != extra]
    assert lines == {extra: 55, partner: 57, **dict.fromkeys(dp_peers, 57)}
