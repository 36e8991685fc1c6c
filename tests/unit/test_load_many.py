"""Several nodes' captures loaded in worker processes give what one process gives: the
analysing node of a large multi-node job reads every other node's capture on every core."""

from __future__ import annotations

import shutil
import time

import psutil

from moe_hang.evidence.load_many import load_captures
from moe_hang.evidence.model import Evidence


def test_captures_loaded_in_workers_equal_one_process_and_a_bad_one_is_named(
        fixtures, tmp_path, monkeypatch):
    from moe_hang.evidence import load_many

    real = load_many.load_capture

    def load(root, **kw):  # the loader notes bad files itself: one that raises all the same
        if root.name == "bad":
            raise RecursionError("deep")
        return real(root, **kw)

    monkeypatch.setattr(load_many, "load_capture", load)  # the forked workers inherit it
    roots = [fixtures / "early_exit_p2p_two_nodes_0" / "node0",
             fixtures / "early_exit_p2p_two_nodes_0" / "node1",
             fixtures / "microbatch_count_0", fixtures / "grad_none_skip_1"]
    bad = tmp_path / "bad"
    shutil.copytree(fixtures / "grad_none_skip_0", bad)
    roots.append(bad)
    started = time.time()
    one = load_captures(roots, workers=1)
    many = load_captures(roots, workers=2)
    assert [type(x) for x in one] == [Evidence] * 4 + [str]
    assert many[4] == one[4] == "RecursionError", one[4]
    for a, b in zip(one[:4], many[:4], strict=True):
        assert isinstance(a, Evidence) and isinstance(b, Evidence)
        assert sorted(a.ranks) == sorted(b.ranks)
        for r in a.ranks:
            x, y = a.ranks[r], b.ranks[r]
            assert (x.posted_log, x.fr, x.error, x.log_status) == (
                y.posted_log, y.fr, y.error, y.log_status)
    # the workers are gone
    assert [p for p in psutil.Process().children(recursive=True)
            if p.create_time() >= started - 0.5] == []
