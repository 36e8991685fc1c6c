"""A pipeline's ranks in a send or a recv, placed by the ops that answer theirs (fresh seed
38502719, job 46, ``silent``, both roles: a 6-stage pipeline under ``diagnose``, stacks
alone; rank C's extra size-1 all-reduce pairs silently with the others' loss). Rank C waits
in its loss (55); its upstream stage in its send to it (47), the stages below in their recv
(44), rank 0 in the next step's accuracy (50). The recv/send ranks were counted as a
majority camp against the collective ones and ranks 0-2 named. Their peers answered their
ops of the previous pass: they are a pass on from rank C, which is a collective behind
them all."""

from __future__ import annotations

from pathlib import Path

import pytest

from moe_hang.analysis.position import pass_on
from moe_hang.analysis.rules import diagnose
from moe_hang.capture.source import read_facts
from moe_hang.evidence.load import load_capture
from moe_hang.evidence.source import SourceFacts, Step
from moe_hang.evidence.stacks import Frame


@pytest.mark.parametrize(("name", "culprit"), [("silent_p2p_2", 2), ("silent_p2p_0", 0)])
def test_ranks_a_pass_on_in_their_recv_put_the_one_behind_them_alone(fixtures, name, culprit):
    d = diagnose(load_capture(fixtures / name)).to_dict()
    assert (d["verdict"], d["culprit_ranks"], d["culprit_basis"]) == (
        "desync", [culprit], "majority"), d["summary"]
    # its peers answered: no send was skipped; it posted one more on the default group
    # before its loss, and the loop's one collective there under a branch is the extra
    assert "never posts" not in d["fix"], d["fix"]
    assert f"Rank {culprit} posted more collectives on default_pg than" in d["fix"], d["fix"]
    assert d["fix"].endswith("_silent_p2p.py:53 <module>."), d["fix"]


PIPE = """\
import torch.distributed as dist
for step in range(4):
    if RANK > 0:
        dist.recv(x, RANK - 1)
    {between}
    if RANK < WORLD - 1:
        dist.send(h, RANK + 1)
    dist.all_reduce(loss)
"""


def _frames(tmp_path: Path, between: str) -> tuple[SourceFacts, str]:
    p = tmp_path / "pipe.py"
    p.write_text(PIPE.format(between=between))
    return read_facts([Frame(str(p), n, "<module>") for n in (4, 7, 8)]), str(p)


def test_a_rank_whose_peer_is_past_the_answer_and_a_collective_it_owes_is_a_pass_on(tmp_path):
    src, f = _frames(tmp_path, "dist.all_reduce(acc)")
    at = [Frame(f, 4, "<module>")]
    # the peer at the loss, past its send and past the accuracy the recv rank has not posted
    assert pass_on(src, at, "recv", [Frame(f, 8, "<module>")]) is True
    # the peer at its own recv, not yet at the send: the same pass
    assert pass_on(src, at, "recv", [Frame(f, 4, "<module>")]) is False


def test_a_peer_past_the_answer_with_nothing_owed_between_may_have_skipped_it(tmp_path):
    src, f = _frames(tmp_path, "pass")
    # nothing the recv rank owes lies between: the peer may have skipped its send this pass
    assert pass_on(src, [Frame(f, 4, "<module>")], "recv", [Frame(f, 8, "<module>")]) is None


def test_the_capture_stores_a_loop_s_sends_and_recvs(tmp_path):
    src, f = _frames(tmp_path, "dist.all_reduce(acc)")
    loop = src.line(f, 8).path[0]
    assert loop.p2p == ((4, "recv"), (7, "send"))
    assert Step.from_list(loop.to_list()) == loop
    assert src.line(f, 7) is not None  # the answering lines are read too
