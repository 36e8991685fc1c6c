"""A collective a rank's own records leave pending that its peers' records show done (fresh
seed 92817364, jobs 24 and 15, ``async`` extra, both roles). Each step posts a token-count
all-reduce with ``async_op=True`` and waits on it at the step's end; at one step the culprit
also posts a gradient-norm all-reduce (size 1) that pairs with the others' gradient
all-reduce (161 floats): gloo aborts it. The ranks killed before their step's wait keep the
token count "scheduled" in their recorder, so, read alone, their line was where it was
posted (the step's first line) and not the gradient all-reduce their stacks are in. Their
peers that raised later completed that same all-reduce (same op, sizes, dtypes) and went on:
every member ran it (:mod:`moe_hang.analysis.peer_done`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from moe_hang.analysis.peer_done import done_by_peers
from moe_hang.analysis.rankstate import rank_view
from moe_hang.analysis.rules import diagnose
from moe_hang.analysis.timeline import RankViews
from moe_hang.evidence.load import load_captures


def _dirs(run: Path) -> list[Path]:
    return [run / "node0", run / "node1"] if (run / "node0").is_dir() else [run]


@pytest.mark.parametrize(("name", "culprit", "extra", "grads", "seq"), [
    ("async_extra_ddp_0", 2, 50, 53, 15), ("async_extra_ddp_1", 1, 50, 53, 15),
    ("async_extra_twonode_0", 4, 49, 54, 10), ("async_extra_twonode_1", 1, 49, 54, 10)])
def test_every_rank_is_at_the_collective_after_the_one_its_peers_completed(
        fixtures, name, culprit, extra, grads, seq):
    d = diagnose(load_captures(_dirs(fixtures / name))).to_dict()
    assert (d["verdict"], d["culprit_ranks"]) == ("desync", [culprit]), d["summary"]
    assert d["first_divergence"]["seq"] == seq, d["first_divergence"]
    at = {r["rank"]: r["callsite"]["line"] for r in d["ranks"]}
    assert at == {r: extra if r == culprit else grads for r in at}, at
    assert f".py:{extra} " in d["fix"] and "pad to a common size" not in d["fix"], d["fix"]


def test_only_what_a_peer_completed_and_went_past_is_done(fixtures):
    """A peer's count takes in the collective it raised in (gloo retires it): only one the
    peer went past says done; and nothing that every member did not post alike."""
    ev = load_captures(_dirs(fixtures / "async_extra_ddp_0"))
    views = RankViews(((r, rank_view(e, ev.source)) for r, e in sorted(ev.ranks.items())),
                      ev.source)
    # ranks 1 and 3 raised in the gradient all-reduce (15): ranks 0 and 2 ran the token
    # count (14); rank 0's 15 and rank 2's 15 (its extra) are not done
    assert done_by_peers(views) == {0: frozenset({("0", 14)}), 2: frozenset({("0", 14)})}


def test_a_member_without_that_collective_leaves_it_undecided(fixtures):
    """A member that never posted it (it skipped it, or died before): the peers' count may
    hold it as completed because it raised there — nothing is claimed."""
    ev = load_captures(_dirs(fixtures / "async_extra_ddp_0"))
    views = RankViews(((r, rank_view(e, ev.source)) for r, e in sorted(ev.ranks.items())),
                      ev.source)
    del views[3].tl.by_pg["0"][14]
    assert done_by_peers(views) == {}
