"""A pipeline of three stages on gloo, from the stacks alone (``diagnose`` of a job run
without moe-hang): the last stage (or the middle one, mirrored) skips a step, so its peer
waits in a ``send`` (or ``recv``) it owes nobody else, while the first stage waits in the
step's all-reduce. Recorded from the generator (fresh seed 36917204, job 061), both roles."""

from __future__ import annotations

import pytest

from moe_hang.analysis.rules import diagnose
from moe_hang.evidence.load import load_capture


@pytest.mark.parametrize("name, skipper", [("stacks_send_wait_0", 2), ("stacks_send_wait_1", 1)])
def test_a_point_to_point_wait_is_owed_by_its_peer_alone(fixtures, name, skipper):
    """Rank 1 waits in a send to rank 2, rank 2 at the final barrier, rank 0 in the
    all-reduce: only rank 2 owed rank 1 anything (the recv), so rank 0 — at a later line than
    the send, its own send long done — is no culprit. Was: ranks 0, 2 "went past what the
    others wait in". Mirrored: rank 2 in a recv from rank 1, rank 1 at the barrier."""
    d = diagnose(load_capture(fixtures / name))
    assert (d.verdict, d.culprit_ranks) == ("desync", [skipper]), d.summary
    if skipper == 2:  # the branch advice names only the rank in that all-reduce
        assert "that rank 0 waits in" in d.fix, d.fix
