"""A collective posted on the wrong process group.

On a device mesh a wrong dim name (or a group object from the wrong branch) sends a rank's
collective to another group: it completes among the ranks that made the same mistake and they
move on, while the group it was meant for waits for them. The evidence is in the recorders:
the culprit called the same line as often as its waiter did, but one of those calls went to
a group the waiter never used there.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from moe_hang.analysis.rankstate import posting_site
from moe_hang.analysis.timeline import RankView, RankViews, group_kind
from moe_hang.evidence.flight_recorder import Collective
from moe_hang.evidence.stacks import Frame


@dataclass(frozen=True)
class WrongGroup:
    rank: int
    site: tuple[str, int] | None  # where the waiter posts it
    op: str
    meant: str  # the group the waiter posts it on (pg name)
    meant_desc: str
    used: str  # the group the culprit posted it on instead
    used_desc: str
    seq: int  # its seq on the group used


def _complete(v: RankView) -> bool:
    """Counting calls needs every call: a recorder that wrapped lost the first ones."""
    return all(min(coll) <= 1 for coll in v.tl.by_pg.values() if coll)


def _line(site: Frame | None) -> tuple[str, int] | None:
    return (site.file, site.line) if site is not None else None


def _calls(v: RankView, like: Collective, site: tuple[str, int] | None) -> list[Collective]:
    """The rank's calls of the same collective: the same line where both are known, else
    the same op on the same sizes (gloo's recorder keeps no frames for finished entries)."""
    def same(c: Collective) -> bool:
        if c.op != like.op:
            return False
        here = _line(posting_site(c, v))
        if here is not None and site is not None:
            return here == site
        return bool(like.input_sizes) and c.input_sizes == like.input_sizes
    return sorted((c for coll in v.tl.by_pg.values() for c in coll.values() if same(c)),
                  key=lambda c: (c.time_created_ns or 0, c.pg, c.seq))


def wrong_group(culprit: int, waiting: Collective, waiter: int,
                views: RankViews) -> WrongGroup | None:
    """Did ``culprit`` post ``waiting`` (what ``waiter`` waits in) on another group?"""
    w, c = views[waiter], views[culprit]
    if not (_complete(w) and _complete(c)):
        return None
    site = _line(posting_site(waiting, w))
    mine, theirs = _calls(w, waiting, site), _calls(c, waiting, site)
    if not mine or len(mine) != len(theirs):
        return None  # a call skipped or added, not redirected
    used = Counter(map(group_kind, theirs)) - Counter(map(group_kind, mine))
    short = Counter(map(group_kind, mine)) - Counter(map(group_kind, theirs))
    if set(short) != {group_kind(waiting)} or len(used) != 1:
        return None
    other = next(iter(used))
    if any(group_kind(x) == other for x in mine):
        return None  # the waiter uses that group for it too: nothing tells which is meant
    extra = [x for x in theirs if group_kind(x) == other][-1]
    return WrongGroup(culprit, site, waiting.op, waiting.pg, waiting.pg_desc, extra.pg,
                      extra.pg_desc, extra.seq)
