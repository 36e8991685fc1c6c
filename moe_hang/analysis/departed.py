"""A rank caught on its way out: its program ended (the probe's last beat came from the
interpreter's exit) while others still wait. Whether that is a job finishing or a rank that
left early is decided by what it posted, never by timing: a rank that exits owes nothing if
it posted every collective the others wait in (they are only slower to return from the last
one); a rank that exits before posting the one a peer waits in, on a group it belongs to,
has left that peer waiting for good (pure)."""

from __future__ import annotations

from dataclasses import replace

from moe_hang.analysis.timeline import RankView, RankViews, StackView, beat_counts
from moe_hang.evidence.probe_records import said_exiting
from moe_hang.evidence.stacks import main_thread
from moe_hang.evidence.vocab import RankState


def _waits(views: RankViews) -> list[tuple[str, int]]:
    """(group, seq) of every collective a rank is blocked in — and of every other one it
    posted that is pending: it waits for those too (one posted after the one its stack is in,
    ``async_op=True``; an older one the recorder has not marked done yet, a little late)."""
    return [(c.pg, c.seq) for v in views.values()
            if v.state == RankState.IN_COLLECTIVE and v.current is not None
            and v.current.completed is False
            for c in (v.current, *(p for coll in v.tl.by_pg.values() for p in coll.values()
                                   if p.completed is False and p is not v.current))]


def _final_counts(v: RankView) -> tuple[dict[str, int], dict[str, int]] | None:
    """(posted, completed) per group, when the rank's last beat came from its interpreter's
    exit with the recorder's final counts (an older probe's had none: nothing is claimed)."""
    hb = v.ev.heartbeat
    if hb is None or not said_exiting(hb) or hb.pg_status is None:
        return None
    # the exit beat is the last word; a recorder dump taken before it may be older (at
    # exit the beat has no pending entry to name a group by: its id is the name torch
    # numbers groups by, and a group it cannot match is left out of every claim)
    posted, done = dict(v.tl.enqueued), dict(v.tl.completed)
    for pg, (enq, completed) in beat_counts(v.ev, hb).items():
        posted[pg] = max(posted.get(pg, -1), enq)
        done[pg] = max(done.get(pg, -1), completed)
    return posted, done


def _sampled_before_exit(v: RankView) -> bool:
    """Its main thread's stack was sampled while its program still ran: a module's top level
    is on it (the script's, or the ``python -m`` module's, or mp.spawn's). Once the
    interpreter's shutdown began — where the exit beat comes from — the main thread runs only
    the shutdown and the atexit handlers, never a module's top level: the beat is newer
    (where the program ended normally, every collective it posted completed: one that raised,
    or left one pending, may have failed in that very collective)."""
    counts = _final_counts(v)
    if v.ev.error is not None or v.ev.fatal or counts is None or any(
            counts[1].get(pg, -1) < n for pg, n in counts[0].items()):
        return False  # it raised, or its exit left one pending: maybe in that very one
    t = main_thread(v.ev.threads or [])
    return t is not None and any(f.function == "<module>" for f in t.frames)


def departing(views: RankViews) -> list[int]:
    """The live ranks on their way out: the last beat came from the interpreter's exit, with
    the recorder's final counts, and no stack shows them inside a collective since (a
    recorder saved before the exit may still show one pending, and a stack sampled before it
    one they were in: they went past it; a collective an atexit handler posts is after it)."""
    return [r for r, v in views.items()
            if v.state != RankState.EXITED and _final_counts(v) is not None
            and (v.stack.op is None or _sampled_before_exit(v))]


def answered_all(views: RankViews, ranks: list[int]) -> set[int]:
    """Those of ``ranks``, gone or going, that had posted every collective the others wait in,
    on groups their final counts name: the others are behind them (still returning from the
    last ones), not left waiting by them. A rank is left out wherever that is not known."""
    if not ranks:  # most diagnoses: no rank is gone or going (8192 ranks: no walk at all)
        return set()
    waits = set(_waits(views))
    if not waits:
        return set()
    out = set()
    for r in ranks:
        counts = _final_counts(views[r])
        if counts is None:
            continue
        posted, done = counts
        # it saw the collective complete, or posted a later one on the group (a blocking
        # collective returns only once done; the recorder marks completion a little late)
        if all((pg in done and done[pg] >= seq) or (pg in posted and posted[pg] > seq)
               for pg, seq in waits):
            out.add(r)
    return out


def as_departed(v: RankView) -> RankView:
    """The view of a rank that has left: exited, in no collective, at no line its stack
    could show (what py-spy samples during the teardown is not where the program stopped)."""
    return replace(v, state=RankState.EXITED, current=None, stack=StackView(RankState.UNKNOWN),
                   site=None)
