"""A training loop and a logging thread that all-reduces a metric on the default group
every 50 ms: two threads of each rank post on one group, and the order their collectives
pair in is each rank's timing. Written as a new user's job (issue 27's trial), recorded under
``moe-hang watch``: gloo aborted the rank whose logger met the other's gradient all-reduce."""

from __future__ import annotations

import pytest

from moe_hang.analysis.rules import diagnose
from moe_hang.evidence.load import load_capture


@pytest.mark.parametrize("name, seq, first", [("thread_same_group", 17, "MainThread"),
                                              ("thread_same_group_first", 5, "Thread-1")])
def test_two_threads_on_the_default_group_are_said_as_such(fixtures, name, seq, first):
    """Was: "Rank 1 skipped an all_reduce from main() ... that rank 0 posted", definite, by
    line order, with "make rank 1 post the collective ... too". Each rank ran its own
    program; each thread's collectives agree across the ranks, only their merge differs.
    The other role (``_first``): the other rank slower, the logger's very first post met
    the other's gradient all-reduce (no earlier history shows the logger on the group)."""
    d = diagnose(load_capture(fixtures / name))
    assert (d.verdict, d.rule_id, d.culprit_ranks, d.certainty) == (
        "desync", "thread_order", [0, 1], "definite"), d.summary
    assert "Two threads of every rank post on default_pg, MainThread at " in d.summary
    assert "Thread-1 (logger_loop) at " in d.summary
    assert f"at seq {seq} rank 0's {first}" in d.summary, d.summary
    div = d.first_divergence
    assert div is not None and div.kind == "order_mismatch"
    assert all(c is not None for c in div.per_rank.values())  # nobody "skipped"
    assert "group of their own" in d.fix and "skipped" not in d.summary
    assert d.fix_site is not None and d.fix_site.function == "logger_loop"
