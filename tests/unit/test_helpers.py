"""A rank's work includes its helpers (issue 28): a rank whose main thread waits outside any
collective while its own child processes (a DataLoader worker decoding a batch, inductor's
compile workers) keep cores busy is working, not stuck."""

from __future__ import annotations

import pytest

from moe_hang.runtime.procs import helpers_cores


def test_helpers_cores_counts_each_helper_from_its_own_start():
    before = {10: (100.0, 5.0), 11: (100.0, 2.0), 12: (100.0, 9.0)}
    # 10 used 1 s; 11 ended (not counted); 12's pid now names a newer process (0.5 s since
    # it started); 13 started in the window (0.5 s)
    after = {10: (100.0, 6.0), 12: (150.0, 0.5), 13: (160.0, 0.5)}
    assert helpers_cores(before, after, 2.0) == pytest.approx(1.0)
    assert helpers_cores({}, {}, 2.0) == 0.0
