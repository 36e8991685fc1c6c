"""The conclusions of posting order: where ranks wait for each other round a cycle, who
closed it (the rank that skipped what its waiter waits in, posted on another group, or posted
two groups' collectives in the other order), and what to change; and two threads of every
rank posting on one group, in an order only timing sets (pure)."""

from __future__ import annotations

from pathlib import Path

from moe_hang.analysis.advice import KIND_ADVICE, Advice, advise_condition
from moe_hang.analysis.align import GroupDivergence
from moe_hang.analysis.conclusion import Conclusion
from moe_hang.analysis.culprit import (
    Blame,
    blame_cycle,
    condition_on,
    cycle_inversion,
    posting_path,
)
from moe_hang.analysis.diagnosis import (
    Certainty,
    CulpritBasis,
    Divergence,
    MismatchKind,
    Verdict,
    fmt_shape,
    pg_label,
)
from moe_hang.analysis.explain import culprit_clause, site_str
from moe_hang.analysis.facts import Facts, situation
from moe_hang.analysis.ladder import Edit
from moe_hang.analysis.p2p import advise_p2p
from moe_hang.analysis.paired import paired_at, skipped_at
from moe_hang.analysis.rankstate import to_rc
from moe_hang.analysis.rate import rate_advice
from moe_hang.analysis.readings import Inversion
from moe_hang.analysis.shift import count_shift, shifted
from moe_hang.analysis.source import excludes_ranks, path_condition_site
from moe_hang.analysis.timeline import group_kind
from moe_hang.analysis.waitfor import Edge
from moe_hang.analysis.wronggroup import WrongGroup, wrong_group
from moe_hang.evidence.flight_recorder import Collective
from moe_hang.evidence.vocab import agree, who


def _cycle_condition(cyc: list[Edge], culprits: set[int], f: Facts) -> Advice | None:
    """The advice where a rank condition set the culprits apart: those that skipped what their
    waiter waits in (an edge on them), else those waiting in an extra of their own."""
    found: list[tuple[int, Advice]] = []
    for e in cyc:
        if e.coll is None:
            continue
        cond = condition_on(e.coll, f.views[e.waiter], f.views)
        if cond is None:
            continue
        what = f"{e.coll.op} {pg_label(e.coll.pg, e.coll.pg_desc)}"
        site = f.views[e.waiter].site
        at = path_condition_site(f.views.source, posting_path(e.coll, f.views[e.waiter]))
        if e.on in culprits and e.waiter not in culprits:
            found.append((1, advise_condition(sorted(culprits), [e.waiter], what, site, cond,
                                              True, at)))
        if e.waiter in culprits and e.on not in culprits and not excludes_ranks(cond):
            # the branch the culprits took, named as such: clearer than the one they left
            found.append((0, advise_condition(sorted(culprits), [e.on], what, site, cond,
                                              False, at)))
    return min(found, key=lambda x: x[0])[1] if found else None


def cycle(f: Facts) -> Conclusion:
    cyc = f.wait_cycles[0]
    # a rank that posted a line's collective on another group than every earlier call and
    # its waiter did is a reading of every cycle, wherever it sits (on a mesh the ranks it
    # went ahead with may be the ones the cycle passes through)
    redirected = _redirected(f)
    moved = sorted({w.rank for w in redirected})
    # a redirected call is the cycle's own reading: no group's extra explains it first
    aligned = _aligned(f, cyc, absent=not redirected)
    b = aligned[1] if aligned is not None else blame_cycle(cyc, f.ctx, moved)
    culprits = set(b.culprits)
    for other in f.wait_cycles[1:]:
        more = _aligned(f, other, absent=not redirected)
        culprits |= set((more[1] if more is not None else
                         blame_cycle(other, f.ctx, moved)).culprits)
    if b.reading is None or b.reading.edit != Edit.GROUP:
        redirected = []
    p2p_only = all(e.coll is None for e in cyc)
    verdict = Verdict.HANG if p2p_only else Verdict.DESYNC
    # posting order alone (NCCL: both enqueued, kernels on two streams): it hung, and this
    # order explains it, but another cause could too
    certainty = Certainty.LIKELY if any(e.stream for e in cyc) else Certainty.DEFINITE
    inv = cycle_inversion(cyc, f.ctx) if b.basis in (CulpritBasis.HISTORY,
                                                       CulpritBasis.MAJORITY) else None
    if inv is not None:
        return _inverted(f, cyc, inv, verdict, certainty)
    parts = [f"rank {e.waiter} waits in {e.what}"
             + (f" at {site_str(f.views[e.waiter].site)}" if f.views[e.waiter].site else "")
             + f" for rank {e.on}" for e in cyc]
    summary = "Deadlock: " + "; ".join(parts) + "."
    if len(f.wait_cycles) > 1:
        summary += f" ({len(f.wait_cycles) - 1} more cycle(s) like it.)"
    # the count shift that decided the divergence the cycle came from, else the cycle's own
    sh = b.shift if aligned is not None else None
    if sh is None and b.basis == CulpritBasis.CYCLE and not redirected \
            and _ended_edge(cyc, f) is None:
        sh = count_shift(cyc, f.ctx)
    if sh is not None:
        verdict, said, counted = shifted(sh, f.views)
        return Conclusion(verdict, sh.culprits, sh.basis, Certainty.LIKELY,
                          summary + said, counted,
                          skipped_at(sh, counted.site, f.views)
                          or paired_at(sh, counted.site, f.views)
                          or next((g.div for g in f.divs if g.div.pg == sh.pg), None))
    summary += culprit_clause(b.basis, sorted(culprits), b.confirmed)
    advice: Advice | None = None
    if p2p_only and b.basis == CulpritBasis.CYCLE:
        text = ("Each rank waits to receive before it sends: order the calls so one side sends "
                "first (e.g. even ranks send then receive, odd ranks receive then send), or "
                "post both with isend/irecv (dist.batch_isend_irecv) and wait on them.")
    elif b.basis == CulpritBasis.CYCLE and (got := _ended_edge(cyc, f)) is not None:
        ended, ended_pg = got
        # a thread that ended will never post what the other side's waits in: not an order
        # a group's seq counts what was posted on it (a ring buffer keeps fewer entries)
        n_w, n_o = (max(f.views[r].tl.by_pg.get(ended_pg, {}) or [0])
                    for r in (ended.waiter, ended.on))
        text = (f"Rank {ended.on}'s thread that posts on the group of {ended.what} has ended: "
                f"it will never post what rank {ended.waiter} waits in. Their threads posted "
                f"different numbers of collectives there ({n_w} against {n_o}): make every "
                "rank's thread post as many (one rank queued one more, or the other one "
                "fewer; which one, this capture does not decide).")
    elif b.basis == CulpritBasis.CYCLE:
        text = ("The ranks post these collectives in opposite orders: post collectives on every "
                "group in the same order on every rank.")
    elif wrong := (redirected or _wrong_groups(culprits, f)):
        w = wrong[0]
        names = who(x.rank for x in wrong)
        used, meant = pg_label(w.used, w.used_desc), pg_label(w.meant, w.meant_desc)
        at = f" at {Path(w.site[0]).name}:{w.site[1]}" if w.site else ""
        held = f.views[w.rank]
        mine = [e for e in f.wait_edges if e.waiter == w.rank]
        now = next((e.what for c in f.wait_cycles for e in c if e.waiter == w.rank), None)
        if any(e.coll is not None and (e.coll.pg, e.coll.seq) == (w.used, w.seq)
               for e in mine):
            # still in the redirected call: the group it went to has moved on without it
            then = f" and waits in it for {who(sorted({e.on for e in mine}))}"
        else:
            then = f" and went on to {now} at {site_str(held.site)}" if now else ""
        meant_kind = w.meant_desc if w.meant_desc not in ("", "undefined") else w.meant
        # those held up by the redirect: waiting on a culprit in its op on the group meant
        waiters = sorted({e.waiter for e in f.wait_edges if e.on in culprits and e.coll
                          and e.coll.op == w.op and group_kind(e.coll) == meant_kind}
                         - culprits) \
            or sorted({e.waiter for c in f.wait_cycles for e in c} - culprits)
        # the redirect is the cause: it leads; the cycle is what it led to
        summary = (f"{names.capitalize()} posted the {w.op}{at} on {used} instead of {meant}"
                   + then + f"; {who(waiters)} "
                   + ("waits" if len(waiters) == 1 else "wait")
                   + f" for {'it' if len(wrong) == 1 else 'them'} in {w.op} on {meant}.")
        text = (f"{names.capitalize()} passed {used} to the {w.op}{at} where the other "
                f"ranks passed {meant}: pass the same group (the same mesh dim) on every rank.")
    elif (p2p := next((e for e in cyc if e.on in culprits and e.p2p is not None), None)) \
            and p2p.p2p is not None:
        text = advise_p2p(p2p.waiter, p2p.p2p.op, p2p.on, f.views[p2p.waiter].site,
                          f.views.source).text
    elif cond := _cycle_condition(cyc, culprits, f):
        text = cond.text
    elif aligned is not None and b.basis == CulpritBasis.HISTORY and aligned[1].reading \
            is not None and (rated := rate_advice(
                aligned[1].reading.culprits, aligned[1].reading.others, aligned[0].div.pg,
                f"on {pg_label(aligned[0].div.pg, aligned[0].div.pg_desc)}", f.views)):
        text = rated
    elif aligned is not None and aligned[1].reading is not None \
            and aligned[1].reading.edit == Edit.EXTRA and aligned[0].absent:
        g = aligned[0]
        extra = next(iter(g.have.values()))
        at = f" at {site_str(f.views[min(g.have)].site)}" if f.views[min(g.have)].site else ""
        text = (f"{who(sorted(culprits)).capitalize()} posted {extra.op} "
                f"{pg_label(extra.pg, extra.pg_desc)}#{extra.seq}{at}, which "
                f"{who(sorted(g.absent))} never {agree(g.absent, 'posts', 'post')}: remove "
                "it there, or make every rank "
                "of that group post it as often.")
    elif (given := _divergence_advice(f, cyc, culprits, b.basis)) is not None:
        advice = given
    else:
        waiter = next(e.waiter for e in cyc if e.on in culprits)
        them = "it" if len(culprits) == 1 else "them"
        text = (f"{who(sorted(culprits)).capitalize()} went past what rank {waiter} waits in "
                f"({next(e.what for e in cyc if e.on in culprits)} at "
                f"{site_str(f.views[waiter].site)}): make {them} post that too, in the same "
                "order.")
    on_cycle = [g for g in f.divs if any(e.coll is not None and e.coll.pg == g.div.pg
                                          for e in cyc)]
    # show the divergence the cycle came from; else the culprits' extra, where they posted
    # it and the others never did; else the group that a culprit skipped (not the one it is
    # held up in)
    read = b.reading
    own = (read.mine.pg, read.mine.seq) if read is not None and read.edit == Edit.EXTRA \
        and read.mine is not None else None
    div = aligned[0].div if aligned is not None else next(
        (g.div for g in on_cycle if (g.div.pg, g.div.seq) == own), next(
            (g.div for g in on_cycle if set(g.absent) & culprits),
            on_cycle[0].div if on_cycle else None))
    if b.basis == CulpritBasis.CYCLE and (got := _ended_edge(cyc, f)) is not None:
        # the group whose poster ended on one side: where the two sides' counts part
        div = next((g.div for g in on_cycle if g.div.pg == got[1]), div)
    if redirected:  # show the group it was meant for, where the others wait for it
        kind = redirected[0].meant_desc or redirected[0].meant
        div = next((g.div for g in f.divs if set(g.absent) & culprits
                    and (g.div.pg_desc or g.div.pg) == kind), div)
    return Conclusion(verdict, sorted(culprits), b.basis, certainty, summary,
                      advice or Advice(text), div)


def _divergence_advice(f: Facts, cyc: list[Edge], culprits: set[int], basis: CulpritBasis
           ) -> Advice | None:
    """One culprit that never posted what its waiter waits in on a group: the advice of that
    group's divergence, where the culprit is absent from it (the branch the source shows
    round it, a loop it left, or what to post)."""
    e = next((e for e in cyc if e.on in culprits and e.coll is not None), None)
    if e is None or e.coll is None or len(culprits) != 1:
        return None
    div = next((g.div for g in f.divs if g.div.pg == e.coll.pg and e.on in g.absent), None)
    # what the present ranks' sizes or dtypes disagree on is no advice for an absent one
    if div is None or div.kind in (MismatchKind.SIZE, MismatchKind.DTYPE):
        return None
    return KIND_ADVICE[div.kind](situation(f, div, [e.on], basis))


def _ended_edge(cyc: list[Edge], f: Facts) -> tuple[Edge, str] | None:
    """An edge whose rank waited on will never post its collective: its thread for that
    group has ended (the edge, and that group)."""
    return next(((e, e.coll.pg) for e in cyc if e.coll is not None
                 and f.views.poster_ended(e.on, e.coll.pg)), None)


def _aligned(f: Facts, cyc: list[Edge], absent: bool = True
             ) -> tuple[GroupDivergence, Blame] | None:
    """Where a group on the cycle diverged before it — its members' histories part at a
    block, or at one seq, and the ladder read who deviated there — that is the cause the
    cycle came from (an extra all-reduce paired silently, and the ranks met again in a send
    and the next all-reduce)."""
    groups = {e.coll.pg for e in cyc if e.coll is not None}
    # a member absent: a cause only where the absent ranks' thread for that group has
    # ended (they will never post it) and the ladder read an extra, or their own skip —
    # else they may be held up before it, by the cycle itself
    found = [(g, b) for g, b in f.causal() if g.div.pg in groups
             and (not g.absent or (absent and b.reading is not None
                                   and (b.reading.edit == Edit.EXTRA
                                        or (b.reading.edit == Edit.SKIP
                                            and set(b.culprits) == set(g.absent)))
                                   and all(f.views.poster_ended(a, g.div.pg)
                                           for a in g.absent)))
             and b.basis not in (CulpritBasis.AMBIGUOUS, CulpritBasis.CYCLE)]
    return found[0] if found else None


def _inverted(f: Facts, cyc: list[Edge], inv: Inversion, verdict: Verdict,
              certainty: Certainty) -> Conclusion:
    def name(c: Collective) -> str:
        return f"{c.op} {pg_label(c.pg, c.pg_desc)}#{c.seq}"  # the lines: below the summary

    why = ("as every rank did in earlier steps" if inv.basis == CulpritBasis.HISTORY
           else f"{len(inv.others)} of {len(inv.others) + len(inv.culprits)} ranks")
    summary = (f"{who(inv.culprits).capitalize()} posted {name(inv.first)} before "
               f"{name(inv.second)}; {who(inv.others)} posted them the other way "
               f"round ({why}): each waits for the other.")
    text = (f"Make {who(inv.culprits)} post {inv.second.op} on "
            f"{pg_label(inv.second.pg, inv.second.pg_desc)} before {inv.first.op} on "
            f"{pg_label(inv.first.pg, inv.first.pg_desc)}, like the others: collectives on "
            "every group in the same order on every rank.")
    # what each side is held in: the culprits the one they posted first, the others theirs
    per_rank = {r: to_rc(f.views[r].current, f.views[r]) for r in inv.culprits + inv.others}
    div = Divergence(inv.second.pg, inv.second.seq, MismatchKind.ORDER, inv.second.pg_desc,
                     sorted(inv.culprits + inv.others), per_rank, phase="order")
    return Conclusion(verdict, inv.culprits, inv.basis, certainty, summary, Advice(text), div)


def _redirected(f: Facts) -> list[WrongGroup]:
    """Every rank some waiter waits on that posted what it waits in on another group — one
    mistake (one line, one group used) on fewer than all the ranks waited on; else none."""
    found: dict[int, WrongGroup] = {}
    for e in f.wait_edges:
        if e.coll is not None and e.on not in found and e.on in f.views and \
                (w := wrong_group(e.on, e.coll, e.waiter, f.views)) is not None:
            found[e.on] = w
    waited_on = {e.on for e in f.wait_edges}
    if not found or len({(w.site, w.used_desc or w.used) for w in found.values()}) != 1 \
            or len(found) >= len(waited_on):
        return []
    return [found[r] for r in sorted(found)]


def _wrong_groups(culprits: set[int], f: Facts) -> list[WrongGroup]:
    """Each culprit that posted what its waiter waits in on another group (all or none)."""
    found = []
    for r in sorted(culprits):
        e = next((e for c in f.wait_cycles for e in c if e.on == r and e.coll is not None),
                 None)
        w = wrong_group(r, e.coll, e.waiter, f.views) if e is not None and e.coll else None
        if w is None:
            return []
        found.append(w)
    return found if len({(w.site, w.used_desc or w.used) for w in found}) == 1 else []


def thread_order(f: Facts) -> Conclusion:
    """Two threads of every rank post on one group (threads.py): each rank ran its own
    program; the order the group's collectives pair in is each rank's timing."""
    race = f.thread_race
    assert race is not None
    first = race.div.div
    # what each member posted where their threads' orders first part (the divergence found
    # later, and its blame's marks, say something else: a skip where none happened)
    div = Divergence(first.pg, race.seq, MismatchKind.ORDER, first.pg_desc,
                     sorted(race.colls), {r: to_rc(c, f.views[r])
                                          for r, c in sorted(race.colls.items())})
    group = pg_label(div.pg, div.pg_desc)
    threads = sorted(race.sites, key=lambda n: (n != "MainThread", n))
    where = " and ".join(f"{n} at {site_str(race.sites[n])}" for n in threads)
    sides: dict[str, list[int]] = {}
    for r, n in sorted(race.roles.items()):
        sides.setdefault(n, []).append(r)
    met = " met ".join(
        f"{who(rs)}'s {n} {race.colls[rs[0]].op}({fmt_shape(race.colls[rs[0]].input_sizes)})"
        for n, rs in sorted(sides.items(), key=lambda kv: kv[1]))
    later = (f"; gloo paired them silently (the same sizes) up to seq {first.seq}, where the "
             "sizes differ" if first.seq is not None and race.seq < first.seq else "")
    summary = (f"Two threads of every rank post on {group}, {where}, in an order each "
               f"rank's timing sets: at seq {race.seq} {met}{later}.")
    helpers = [n for n in threads if n != "MainThread"] or threads[1:]
    named = " and ".join(helpers)
    site = race.sites.get(helpers[0])
    text = (f"Give {named}'s collectives a group of their own (g = dist.new_group(...), "
            "created on every rank in the same order before the thread starts; then "
            f"all_reduce(..., group=g)), or post them from one thread: a group's collectives "
            "pair by their order on each rank, and two threads' order on one group is timing.")
    culprits = sorted(race.roles)
    return Conclusion(Verdict.DESYNC, culprits, CulpritBasis.THREAD_ORDER, Certainty.DEFINITE,
                      summary, Advice(text, site=site,
                                      site_why=f"{named}'s collective on {group}"), div)
