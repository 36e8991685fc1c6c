"""Who is to blame, from evidence only (docs/DESIGN.md §8): the minority at a divergence;
else the rank further along the same code (it went past what the others wait in); else what
earlier iterations did; else every candidate, said to be ambiguous. Never by rank number or
dict order. Pure."""

from __future__ import annotations

from dataclasses import dataclass, replace

from moe_hang.analysis.align import GroupDivergence
from moe_hang.analysis.blocks import condition_of
from moe_hang.analysis.diagnosis import CulpritBasis, Divergence, MismatchKind, RankCollective
from moe_hang.analysis.mismatch import ROW
from moe_hang.analysis.order import (
    Ahead,
    Inversion,
    breaks_history,
    further_along,
    inversion,
    program_order,
    user_frames,
    who_skipped,
)
from moe_hang.analysis.source import excludes_ranks
from moe_hang.analysis.timeline import RankView, RankViews, group_kind, site_key
from moe_hang.analysis.waitfor import Edge
from moe_hang.evidence.flight_recorder import Collective
from moe_hang.evidence.model import SizeAbort
from moe_hang.evidence.ops import nbytes
from moe_hang.evidence.stacks import Frame


@dataclass
class Blame:
    culprits: list[int]
    basis: CulpritBasis
    confirmed: bool = True  # False: program order from line numbers only
    causal: bool = True  # False: its absent ranks are held up elsewhere (a consequence)


def minority(groups: list[list[int]]) -> list[int] | None:
    """Majority vote over groups of ranks that agree: the ranks outside the largest group when
    it is strictly bigger than every other, else None (no majority: blame is undecided)."""
    ranked = sorted(groups, key=len, reverse=True)
    if len(ranked) > 1 and len(ranked[0]) > len(ranked[1]):
        return sorted(r for rs in ranked[1:] for r in rs)
    return None


def _sides(items: dict[int, object]) -> list[list[int]]:
    groups: dict[object, list[int]] = {}
    for r, key in sorted(items.items()):
        groups.setdefault(key, []).append(r)
    return list(groups.values())


def _two_sides(sides: list[list[int]], have: dict[int, Collective],
               views: RankViews) -> Blame | None:
    """Two equal camps: the one that went past the other's collective skipped it."""
    if len(sides) != 2:
        return None
    ra, rb = sides
    # a rank condition on one side's path decides first (``if rank == 0: evaluate()``
    # posts an extra there; line numbers would call the other side "further along")
    extra = [rs for rs in sides if extra_by_source(have[rs[0]], views, rs[0])]
    if len(extra) == 1:
        return Blame(extra[0], CulpritBasis.SOURCE)
    kept = [rs for rs in sides if skipped_by_source(have[rs[0]], views, rs[0])]
    if len(kept) == 1:  # what that side posts, the other side's condition left out
        return Blame(rb if kept[0] is ra else ra, CulpritBasis.SOURCE)
    ahead = who_skipped(have[ra[0]], have[rb[0]], views, ra, rb)
    if ahead.side is None:
        return None
    return Blame(ra if ahead.side == "a" else rb, ahead.basis, ahead.confirmed)


def _tag_ahead(g: GroupDivergence, views: RankViews) -> list[int] | None:
    """Probe tags (layer1.expert2): the rank whose collective here is the one the others post
    *next* is ahead by one: it skipped the one in between."""
    pg, seq = g.div.pg, g.div.seq or 0
    tags = {r: c.tag for r, c in g.have.items() if c.tag}
    ahead = [r for r, tag in tags.items()
             if any(q != r and tags[q] != tag
                    and (nxt := views[q].tl.by_pg.get(pg, {}).get(seq + 1)) is not None
                    and nxt.tag == tag for q in tags)]
    return sorted(ahead) or None


def blame(g: GroupDivergence, views: RankViews) -> Blame:
    """The culprits of one group's divergence."""
    if g.div.kind == MismatchKind.MISSING and g.absent:
        return _blame_absent(g, views)
    if g.block is not None:  # one side posted collectives the other did not
        if g.block.decided is None:
            return Blame(g.block.culprits, CulpritBasis.AMBIGUOUS)
        return Blame(g.block.culprits, g.block.basis)
    if g.identity:
        sides = _sides(g.identity)
        if (tagged := _tag_ahead(g, views)) is not None:
            return Blame(tagged, CulpritBasis.PROGRAM_ORDER)
    else:
        same = ROW[g.div.kind].same
        reps: list[tuple[Collective, list[int]]] = []
        for r, c in sorted(g.have.items()):
            for rep, rs in reps:
                if same(rep, c):
                    rs.append(r)
                    break
            else:
                reps.append((c, [r]))
        sides = [rs for _, rs in reps]
        if g.div.kind in (MismatchKind.SIZE, MismatchKind.DTYPE):
            # a rank gloo aborted, placed here by its peers (reconcile) with nothing of its
            # own tensor known, is no camp of its own: it would make the one rank that
            # differs look like half a tie
            known = [rs for rs in sides if not all(_unknown_shape(g.have[r]) for r in rs)]
            if known and len(known) < len(sides):
                sides = known
    least = minority(sides)
    if least is not None:
        return Blame(least, CulpritBasis.MAJORITY)
    if g.div.kind in (MismatchKind.OP, MismatchKind.MISSING):
        two = _two_sides(sides, g.have, views)
        if two is not None:
            return two
    if (odd := _breaks_constant(sides, g.have, views)) is not None:
        return Blame(odd, CulpritBasis.HISTORY)
    return Blame(sorted(g.have), CulpritBasis.AMBIGUOUS)


def _unknown_shape(c: Collective) -> bool:
    return c.source == "reconciled" and not c.input_sizes and not c.dtypes


def _signature(c: Collective) -> tuple[object, ...]:
    return (c.op, tuple(tuple(s) for s in c.input_sizes), tuple(c.dtypes))


def _keeps_constant(c: Collective, views: RankViews) -> bool | None:
    """Every earlier (completed) collective of this op on a group like this one, from this
    call site where the recorder has one (else from any), had one signature (op, sizes,
    dtypes): does ``c`` have it? None: no history, or it varies (ragged sizes: history cannot
    tell)."""
    kind, site = group_kind(c), site_key(c)
    done = [h for v in views.values() for by_seq in v.tl.by_pg.values()
            for h in by_seq.values()
            if h.completed is True and h.op == c.op and group_kind(h) == kind
            and not (h.pg == c.pg and h.seq >= c.seq)]  # history: before this one
    # its own call site's history, else — a call site never used before — the op's on this
    # kind of group, whatever posted it: every rank kept one shape there
    here = [h for h in done if site_key(h) == site] or done
    seen = {_signature(h) for h in here}
    if len(seen) != 1:
        # other shapes earlier on (a warm-up, where no call site tells them apart): the
        # steps right before this one, if they kept one shape
        recent = {h.seq: _signature(h) for h in here if h.pg == c.pg}
        last = [recent[s] for s in sorted(recent)[-3:]]
        if len(last) < 3 or len(set(last)) != 1:
            return None
        seen = set(last)
    return _signature(c) in seen


def _breaks_constant(sides: list[list[int]], have: dict[int, Collective],
                     views: RankViews) -> list[int] | None:
    """Two camps, no majority: the one whose collective differs from what this collective
    always was in earlier steps, while the other's is just that."""
    if len(sides) != 2:
        return None
    # a side whose sizes are not known (a dead rank's) keeps or breaks nothing
    keeps = [_keeps_constant(have[rs[0]], views) if have[rs[0]].input_sizes else None
             for rs in sides]
    if keeps == [True, False]:
        return sides[1]
    if keeps == [False, True]:
        return sides[0]
    return None


def _posted_before(c: Collective, views: RankViews) -> bool | None:
    """The same collective was posted, and completed, in earlier steps: from ``c``'s line on
    its kind of group; where the recorder kept no lines, the same op and sizes there. None
    when no rank holds a completed collective of that kind of group (heartbeats alone, a
    recorder that kept nothing): absence of history is not history. One scan of every
    rank's history per question (a wait-for cycle asks it for each of its edges)."""
    site = site_key(c)
    key = ("posted_before", site, group_kind(c), c.pg, c.seq, c.op, str(c.input_sizes))
    if key in views.memo:
        return views.memo[key]  # type: ignore[return-value]
    views.memo[key] = answer = _scan_history(c, site, views)
    return answer


def _scan_history(c: Collective, site: object, views: RankViews) -> bool | None:
    seen = False
    for v in views.values():
        for by_seq in v.tl.by_pg.values():
            for h in by_seq.values():
                if h.completed is not True or (h.pg, h.seq) == (c.pg, c.seq) \
                        or group_kind(h) != group_kind(c):
                    continue
                seen = True
                hs = site_key(h)
                if (hs == site) if hs is not None and site is not None else \
                        (h.op, h.input_sizes) == (c.op, c.input_sizes):
                    return True
    return False if seen else None


def condition_on(c: Collective, v: RankView, views: RankViews) -> str | None:
    """The rank condition on the user path that posted ``c`` (the recorder's frames, else the
    stack of the rank still blocked in it)."""
    if c.frames or c.completed is not False or v.stack.op != c.op:
        return condition_of(c, views)
    return condition_of(replace(c, frames=list(v.stack.frames)), views)


def extra_by_source(c: Collective, views: RankViews, waiter: int) -> bool:
    """``c`` runs under a rank condition (``if rank == 0:`` on its user path, read from the
    source) and nothing like it was posted in earlier steps: an extra of the ranks that took
    that branch, not a collective the others skipped."""
    cond = condition_on(c, views[waiter], views)
    return cond is not None and not excludes_ranks(cond) and _posted_before(c, views) is False


def skipped_by_source(c: Collective, views: RankViews, waiter: int) -> bool:
    """``c`` runs under a rank condition and every earlier step posted it: a rank that is not
    in it took the other branch (``if not (bad_rank and step == 3): dist.broadcast(...)``) —
    in a loop, line numbers cannot say that it went on to the next step. Or the condition
    itself names the ranks that do not run it (``if rank != 3``)."""
    cond = condition_on(c, views[waiter], views)
    return cond is not None and (excludes_ranks(cond) or _posted_before(c, views) is True)


def _blame_absent(g: GroupDivergence, views: RankViews) -> Blame:
    """Members that never posted it: those further along skipped it (culprits); those behind
    are held up earlier (this divergence is then a consequence) — unless what the others
    wait in is an extra of theirs, posted under a rank condition (then they are)."""
    waiter = next((r for r, c in g.have.items() if c.completed is not True), next(iter(g.have)))
    if extra_by_source(g.have[waiter], views, waiter):
        return Blame(sorted(g.have), CulpritBasis.SOURCE)
    if skipped_by_source(g.have[waiter], views, waiter):
        return Blame(sorted(g.absent), CulpritBasis.SOURCE)
    verdicts: dict[int, Ahead] = {a: further_along(a, g.have[waiter], views, waiter)
                                  for a in g.absent}
    ahead = sorted(a for a, v in verdicts.items() if v.side == "a")
    behind = [a for a, v in verdicts.items() if v.side == "b"]
    if ahead:
        basis = verdicts[ahead[0]].basis
        return Blame(ahead, basis, all(verdicts[a].confirmed for a in ahead))
    if behind and len(behind) == len(g.absent):
        return Blame(sorted(behind), CulpritBasis.PROGRAM_ORDER, causal=False)
    return Blame(sorted(g.absent), CulpritBasis.AMBIGUOUS)


def blame_cycle(cycle: list[Edge], views: RankViews) -> Blame:
    """On a wait-for cycle, a rank that went past what its waiter waits in skipped it; when
    no edge tells, every rank on the cycle is named."""
    ranks = sorted({e.waiter for e in cycle})
    extras = sorted({e.waiter for e in cycle
                     if e.coll is not None and extra_by_source(e.coll, views, e.waiter)})
    if extras and len(extras) < len(ranks):  # what they wait in only they run
        return Blame(extras, CulpritBasis.SOURCE)
    skippers = sorted({e.on for e in cycle
                       if e.coll is not None and skipped_by_source(e.coll, views, e.waiter)})
    if skippers and len(skippers) < len(ranks):  # what the others wait in, they skipped
        return Blame(skippers, CulpritBasis.SOURCE)
    ahead: list[int] = []
    confirmed = True
    basis = CulpritBasis.PROGRAM_ORDER
    for e in cycle:
        target = e.coll
        if target is None:  # point-to-point: compare where the two ranks are
            verdict = further_along(e.on, _stand_in(e.waiter, views), views, e.waiter)
        else:
            verdict = further_along(e.on, target, views, e.waiter)
        if verdict.side == "a":
            ahead.append(e.on)
            confirmed &= verdict.confirmed
            basis = verdict.basis
    if ahead and len(set(ahead)) < len(ranks):
        return Blame(sorted(set(ahead)), basis, confirmed)
    inv = cycle_inversion(cycle, views)
    if inv is not None:
        return Blame(inv.culprits, inv.basis)
    # exclusive branches (no order between them): did one rank break what earlier
    # iterations did (the others doing what they always did)?
    broke = {r: breaks_history(r, views) for r in ranks}
    deviating = sorted(r for r, b in broke.items() if b is True)
    if deviating and any(b is False for b in broke.values()):
        return Blame(deviating, CulpritBasis.HISTORY)
    return Blame(ranks, CulpritBasis.CYCLE)


def cycle_inversion(cycle: list[Edge], views: RankViews) -> Inversion | None:
    """A cycle through two collectives of different groups that its ranks posted in opposite
    orders (every one posted both: NCCL enqueues without waiting)."""
    colls = {(e.coll.pg, e.coll.seq): e.coll for e in cycle if e.coll is not None}
    if len(colls) != 2:
        return None
    x, y = colls.values()
    return inversion(x, y, views) if x.pg != y.pg else None


def _stand_in(rank: int, views: RankViews) -> Collective:
    """A placeholder for where a rank waits in a point-to-point call (its position)."""
    return Collective(pg="p2p", seq=-1, op=views[rank].stack.op or "p2p", frames=[])


def _posted_from(r: int, div: Divergence, views: RankViews) -> list[Frame]:
    """The user frames that posted rank r's collective at the divergence (the recorder's),
    else where the rank is (a rank that aborted inside it left its stack)."""
    c = views[r].tl.by_pg.get(div.pg, {}).get(div.seq) if div.seq is not None else None
    return (user_frames(c.frames) if c is not None and c.frames else []) or views[r].position


def _nbytes(c: RankCollective) -> int | None:
    return nbytes(c.input_sizes, c.dtypes)


def blame_abort(div: Divergence, views: RankViews, abort: SizeAbort | None,
                aborted: list[int]) -> Blame:
    """gloo aborted a rank (a peer sent more bytes than it expected) before it could dump
    its recorder: camps by the line each posted from (a rank that went past posts from
    another line); on one line, by bytes — where the abort's byte ratio matches the two sizes
    the others posted, the aborted rank is the one that expected less."""
    entries = {r: c for r, c in div.per_rank.items() if c is not None}
    # a rank whose line is not known (a recorder without frames, a stack without the main
    # thread) is no camp of its own: it would make the ranks whose line is known look
    # like the majority against it
    sites = {r: (c.op, (c.callsite.file, c.callsite.line))
             for r, c in entries.items() if c.callsite is not None}
    sides = _sides(dict(sites))
    if len(sides) > 1:
        least = minority(sides)
        if least is not None:
            return Blame(least, CulpritBasis.MAJORITY)
        if len(sides) == 2:
            ahead = program_order(_posted_from(sides[0][0], div, views),
                                  _posted_from(sides[1][0], div, views), views.source)
            if ahead.side is not None:
                return Blame(sides[0] if ahead.side == "a" else sides[1], ahead.basis,
                             ahead.confirmed)
        return Blame(sorted(entries), CulpritBasis.AMBIGUOUS)
    sizes = {r: b for r, c in entries.items() if (b := _nbytes(c)) is not None}
    distinct = sorted(set(sizes.values()))
    if abort is not None and abort.received and abort.expected and len(distinct) == 2:
        ratio = abort.received / abort.expected
        if abs(distinct[1] / distinct[0] - ratio) < 0.01 * ratio:
            for r in aborted:  # it expected the smaller message: it holds the smaller tensor
                sizes.setdefault(r, distinct[0])
    least = minority(_sides(dict(sizes)))
    if least is not None:
        return Blame(least, CulpritBasis.MAJORITY)
    if (odd := _known_side_history(div, views, sizes, sorted(entries))) is not None:
        return odd
    return Blame(sorted(entries), CulpritBasis.AMBIGUOUS)


def _known_side_history(div: Divergence, views: RankViews, sizes: dict[int, int],
                        ranks: list[int]) -> Blame | None:
    """One camp's sizes known (the survivors'), the aborted rank's not (gloo's byte counts of
    a ring's chunks say nothing of its tensor): the known collective either is the shape
    that collective always had — then the other side changed — or is not — then it did.
    Likely, not definite: the unknown side is inferred, not seen."""
    known = sorted(sizes)
    unknown = [r for r in ranks if r not in sizes]
    if not known or not unknown or len(set(sizes.values())) != 1 or div.seq is None:
        return None
    c = views[known[0]].tl.by_pg.get(div.pg, {}).get(div.seq)
    keeps = _keeps_constant(c, views) if c is not None and c.input_sizes else None
    if keeps is None:
        return None
    return Blame(unknown if keeps else known, CulpritBasis.HISTORY, confirmed=False)
