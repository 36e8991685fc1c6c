"""Watch by sampling: what ``watch`` does when the probe is not running in the ranks (the
job's script replaced PYTHONPATH, ...). Each round is the window ``diagnose`` takes (a few
py-spy samples, counters and CPU: capture/window.py), read the way ``diagnose`` reads it: a
rank moved when its stack moved, its main thread kept computing, or its counters show
collectives completing (analysis/activity.py; docs/DESIGN.md §9)."""

from __future__ import annotations

from moe_hang.analysis.activity import Motion, judge
from moe_hang.capture import window
from moe_hang.runtime.watchevent import RoundRank, Sampler
from moe_hang.settings import Settings


def sampler(settings: Settings, *, native: bool = False) -> Sampler:
    def take(pids: dict[int, int]) -> dict[int, RoundRank]:
        out = {}
        for r, w in window.sample_window(pids, settings, native=native,
                                         locals_last=False).items():
            data = w.final.data
            inside = data is not None and window.in_collective(data)
            j = judge(w.activity) if inside else None
            moved = w.moved
            if j is not None and j.motion == Motion.MOVING:
                moved = True
            out[r] = RoundRank(moved=moved, fingerprint=window.fingerprint(data)
                               if data is not None else None, in_collective=inside,
                               activity=w.activity, error=w.final.error)
        return out

    return take
