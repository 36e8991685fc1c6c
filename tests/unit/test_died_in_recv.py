"""A rank ended while in a send/recv gloo does not record (fresh seed 38502719, job 56,
``sigkill``, both roles: a 4-stage pipeline beside a busy neighbour; rank C is SIGKILLed at
step 3 before its send, the next stages wait in their recv, gloo raises in one, and torchrun
SIGTERMs the rest). With nothing pending in its recorder, a rank that ended was read as
dying in its last recorded collective (the previous step's broadcast, 60): the stack it
died with — the faulthandler dump on the SIGTERM, or the traceback it raised — is fresher
and says recv (46)."""

from __future__ import annotations

import pytest

from moe_hang.analysis.rules import diagnose
from moe_hang.evidence.load import load_capture


@pytest.mark.parametrize(("name", "killed", "in_recv"), [
    ("sigkill_recv_0", 0, {1, 2, 3}),  # its next stages wait in their recv from it
    ("sigkill_recv_2", 2, {3}),        # rank 3 in its recv; ranks 0-1 in the stats
])
def test_a_rank_ended_in_a_recv_is_at_the_recv_not_its_last_recorded_collective(
        fixtures, name, killed, in_recv):
    d = diagnose(load_capture(fixtures / name)).to_dict()
    assert (d["verdict"], d["culprit_ranks"]) == ("rank_died", [killed]), d["summary"]
    lines = {r["rank"]: r["callsite"]["line"] for r in d["ranks"] if r["rank"] != killed}
    assert {r for r, ln in lines.items() if ln == 46} == in_recv, lines
    assert all(ln == 55 for r, ln in lines.items() if r not in in_recv), lines
