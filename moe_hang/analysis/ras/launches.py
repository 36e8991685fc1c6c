"""RAS's launch counts read with the rest of the evidence (pure), across two polls: counts
that disagree and stay frozen name the ranks behind, which never launched what the others
wait in (``desync``), followed across communicators through the processes and checked against
the recorder and the stacks — a contradiction is said, and lowers the certainty; counts that
moved mean the job launches collectives (``healthy``); one report's counts that differ name a
candidate, uncertainly. Every sentence built from counts carries the launch caveat
(:func:`~moe_hang.analysis.ras.counts.with_launch_caveat`): launches, not completions; no
send/recv, so no all-to-all (docs/DESIGN.md §13)."""

from __future__ import annotations

from dataclasses import dataclass, field

from moe_hang.analysis.advice import Advice
from moe_hang.analysis.conclusion import Conclusion
from moe_hang.analysis.diagnosis import (
    Certainty,
    CulpritBasis,
    Divergence,
    MismatchKind,
    RankCollective,
    Verdict,
    pg_label,
)
from moe_hang.analysis.facts import Facts
from moe_hang.analysis.ras.common import (
    Proc,
    cap,
    comm_name,
    comm_of,
    global_ranks_of,
    proc_of,
    ras_of,
    site_text,
    who_in,
)
from moe_hang.analysis.ras.counts import ordinal, with_launch_caveat
from moe_hang.analysis.ras.findings import FindingKind, RasFinding
from moe_hang.analysis.ras.reading import RasReading
from moe_hang.evidence.flight_recorder import Collective
from moe_hang.evidence.stacks import Frame, callsite
from moe_hang.evidence.vocab import RankState, spans
from moe_hang.evidence.vocab import who as ranks_who

# ----------------------------------------------------------------------------- frozen counts


@dataclass
class Behind:
    """One frozen communicator whose counts disagree."""

    finding: RasFinding
    behind: list[Proc]
    ahead: list[Proc]


@dataclass
class FrozenMismatch:
    primary: Behind  # the first communicator whose ranks behind wait on nobody (the cause)
    causes: list[Behind]  # every such communicator (primary first)
    culprits: list[int]  # global ranks (mapped) of the ranks behind in them
    chain: list[Behind]  # the other communicators, held up through them
    cycle: bool  # every rank behind is itself ahead elsewhere: they wait for each other
    agree: list[str] = field(default_factory=list)  # the recorder and stacks, agreeing
    disagree: list[str] = field(default_factory=list)  # ... contradicting
    div: Divergence | None = None
    line: Frame | None = None  # where the ranks ahead posted what the ranks behind never did
    moving: list[int] = field(default_factory=list)  # ranks behind whose stacks moved


def _behind(ras: RasReading, x: RasFinding) -> Behind:
    c = comm_of(ras, x.comm)
    return Behind(x, [p for r in x.ranks if (p := proc_of(c, r)) is not None],
                  [p for r in x.ahead_ranks if (p := proc_of(c, r)) is not None])


def frozen_mismatch(f: Facts) -> FrozenMismatch | None:
    """Two polls, and a communicator in which nothing moved while its counts disagree. Across
    communicators: a rank behind in one that is ahead in another waits there (it launched and
    blocks on it), so the cause is where the ranks behind wait on nobody."""
    ras = ras_of(f)
    if ras is None or not ras.compared:
        return None
    found = [_behind(ras, x) for x in ras.comparison.of(FindingKind.FROZEN_MISMATCH)]
    if not found:
        return None
    waiting = {p for b in found for p in b.ahead}
    # the ranks behind wait on nobody (a text report names no process: each is its own cause)
    roots = [b for b in found if not b.behind or not set(b.behind) & waiting]
    cycle = not roots
    causes = roots or found  # a cycle: every rank behind, the counts do not say who began it
    culprits = sorted({g for b in causes for g in global_ranks_of(ras, b.finding.comm,
                                                           b.finding.ranks)})
    out = FrozenMismatch(causes[0], causes, culprits, [b for b in found if b not in causes],
                         cycle=cycle)
    _reconcile(f, ras, out)
    return out


def _pg_for(f: Facts, members: set[int]) -> list[str]:
    """The process groups (by name) whose members are exactly these global ranks."""
    out: set[str] = set()
    for v in f.views.values():
        fr = v.ev.fr
        groups: list[tuple[str, set[int]]] = [
            (pg, set(rs)) for pg, rs in (fr.pg_ranks.items() if fr is not None else ())]
        groups += [(pg, set(rs)) for pg, rs in (v.ev.groups or {}).items()]
        out |= {pg for pg, rs in groups if rs == members}
    return sorted(out)


def _reconcile(f: Facts, ras: RasReading, m: FrozenMismatch) -> None:
    """What the recorder and the stacks say of the ranks behind: agreeing, or not."""
    x = m.primary.finding
    ahead = global_ranks_of(ras, x.comm, x.ahead_ranks)
    for g in m.culprits:
        v = f.views.get(g)
        if v is None:
            continue
        if g in f.moving or v.ev.progressed:
            m.moving.append(g)
            m.disagree.append(f"rank {g}'s stack moved between samples: it may still be on "
                              "its way to that collective")
        elif v.current is not None:
            c = v.current
            m.agree.append(f"rank {g} waits in {c.op} {pg_label(c.pg, c.pg_desc)}#{c.seq}"
                           + (f" at {site_text(v.site)}" if v.site else ""))
        elif v.state == RankState.IN_COLLECTIVE and v.stack.op:
            m.agree.append(f"rank {g} waits in {v.stack.op}"
                           + (f" at {site_text(v.site)}" if v.site else ""))
        elif v.site is not None:
            m.agree.append(f"rank {g} is at {site_text(v.site)}")
    # the recorder, for the first cause: the group with that communicator's members
    behind = global_ranks_of(ras, x.comm, x.ranks)
    members = set(global_ranks_of(ras, x.comm, tuple(range(x.comm_size)))) if x.comm_size else set()
    pgs = _pg_for(f, members) if members and len(members) == x.comm_size else []
    for pg in pgs:
        enq = {g: f.views[g].tl.enqueued.get(pg) for g in behind + ahead if g in f.views}
        known_b = [e for g in behind if (e := enq.get(g)) is not None]
        known_a = [e for g in ahead if (e := enq.get(g)) is not None]
        if not known_b or not known_a:
            continue
        top = max(known_a)
        label = pg_label(pg, _desc(f, pg))
        if max(known_b) < top:
            m.agree.append(f"the recorder agrees: rank {spans(behind)} last posted {label}"
                           f"#{max(known_b)}, rank {spans(ahead)} #{top}")
            m.div = _divergence(f, pg, max(known_b) + 1, behind, ahead)
            a0 = next((g for g in ahead if g in f.views), None)
            coll = f.views[a0].tl.by_pg.get(pg, {}).get(max(known_b) + 1) if a0 is not None \
                else None
            if coll is not None and coll.frames:
                m.line = callsite(coll.frames)
        else:
            m.disagree.append(f"the recorder shows rank {spans(behind)} posted as many "
                              f"collectives of {label} as rank {spans(ahead)} (#{top}): "
                              "RAS has not counted a launch the recorder holds")
        break


def _desc(f: Facts, pg: str) -> str:
    for v in f.views.values():
        if v.ev.fr is not None and pg in v.ev.fr.pg_desc:
            return v.ev.fr.pg_desc[pg]
    return ""


def _divergence(f: Facts, pg: str, seq: int, behind: list[int], ahead: list[int]
                ) -> Divergence:
    per: dict[int, RankCollective | None] = {g: None for g in behind}
    for g in ahead:
        v = f.views.get(g)
        c = v.tl.by_pg.get(pg, {}).get(seq) if v is not None else None
        if c is not None:
            per[g] = _rc(c)
    return Divergence(pg, seq, MismatchKind.MISSING, _desc(f, pg), sorted(behind + ahead),
                      per)


def _rc(c: Collective) -> RankCollective:
    return RankCollective(op=c.op, pg=c.pg, seq=c.seq, input_sizes=c.input_sizes,
                          dtypes=c.dtypes, source=c.source, pg_desc=c.pg_desc,
                          time_created_ns=c.time_created_ns, tag=c.tag,
                          callsite=callsite(c.frames) if c.frames else None, state=c.state)


def _missed(x: RasFinding) -> str:
    """The first launch the ranks behind lack: ``151st`` (``149th (of up to 151)``)."""
    first = (x.count or 0) + 1
    return ordinal(first) + (f" (of up to {x.ahead})" if x.ahead and x.ahead > first else "")


def _ahead(ras: RasReading, x: RasFinding) -> str:
    if x.ahead_ranks:
        return who_in(ras, x.comm, x.ahead_ranks)
    return f"the other {x.comm_size - x.n_ranks}" if x.comm_size > x.n_ranks else "the others"


def ras_desync(f: Facts) -> Conclusion:
    m = frozen_mismatch(f)
    ras = ras_of(f)
    assert m is not None and ras is not None
    x = m.primary.finding
    c = comm_of(ras, x.comm)
    who = who_in(ras, x.comm, x.ranks, x.n_ranks)
    when = f"in {ras.interval_s:.1f} s" if ras.interval_s is not None else "between the polls"
    line = f" (at {site_text(m.line)})" if m.line is not None else ""
    summary = with_launch_caveat(
        f"{cap(who)} never launched the {_missed(x)} {x.op} of {comm_name(c, x.comm)} "
        f"that {_ahead(ras, x)} launched{line}, and no rank launched anything there {when}: "
        f"it cannot complete without {'it' if x.n_ranks == 1 else 'them'}")
    for b in m.causes[1:]:
        y = b.finding
        summary += (f" {cap(who_in(ras, y.comm, y.ranks, y.n_ranks))} never launched the "
                    f"{_missed(y)} {y.op} of {comm_name(comm_of(ras, y.comm), y.comm)} that "
                    f"{_ahead(ras, y)} launched.")
    if m.cycle:
        summary += (" Every rank behind is ahead in another communicator: they wait for each "
                    "other (communicators launched in different orders), and the counts do "
                    "not say who began it — their stacks would.")
    elif m.chain:
        held = sorted({g for b in m.chain for g in global_ranks_of(ras, b.finding.comm,
                                                              b.finding.ahead_ranks)})
        summary += (f" {len(m.chain)} other communicator(s) are held up behind "
                    f"{'it' if len(m.culprits) <= 1 else 'them'}"
                    + (f" ({ranks_who(held)} wait there)" if held else "") + ".")
    if m.agree:
        summary += " " + cap("; ".join(m.agree)) + "."
    certainty = Certainty.UNCERTAIN if m.cycle else Certainty.LIKELY
    if m.disagree:
        summary += " But " + "; ".join(m.disagree) + ": the evidence disagrees."
        certainty = Certainty.UNCERTAIN
    target = (f"rank {spans(m.culprits)}" if m.culprits
              else who_in(ras, x.comm, x.ranks, x.n_ranks, short=True))
    now = next((f.views[g] for g in m.culprits if g in f.views and f.views[g].site), None)
    proc = proc_of(c, x.ranks[0]) if x.ranks else None
    where = (f"it is at {site_text(now.site)} instead" if now is not None and now.site
             else f"`py-spy dump --pid {proc[1]}` on {proc[0]} says where it is instead"
             if proc is not None else "its stack says where it is instead")
    text = (f"Find why {target} did not reach the {x.op} the others launched"
            + (f" ({site_text(m.line)})" if m.line is not None else "")
            + f" — {where}: every member of a communicator must launch the same collectives "
              "in the same order.")
    return Conclusion(Verdict.DESYNC, m.culprits, CulpritBasis.LAUNCH_COUNTS, certainty,
                      summary, Advice(text), m.div)


# ----------------------------------------------------------------------------- one poll


def counts_differ(f: Facts) -> list[RasFinding]:
    ras = ras_of(f)
    if ras is None or ras.compared:
        return []
    return list(ras.comparison.of(FindingKind.COUNTS_DIFFER))


def ras_one_poll_mismatch(f: Facts) -> Conclusion:
    ras = ras_of(f)
    found = counts_differ(f)
    assert ras is not None and found
    x = found[0]
    c = comm_of(ras, x.comm)
    culprits = sorted({g for y in found for g in global_ranks_of(ras, y.comm, y.ranks)})
    summary = with_launch_caveat(
        f"In one RAS report {who_in(ras, x.comm, x.ranks, x.n_ranks)} had launched the {x.op} "
        f"of {comm_name(c, x.comm)} {x.count} times, {_ahead(ras, x)} {x.ahead} times: if "
        f"that stays, {'it' if x.n_ranks == 1 else 'they'} never launched what the others "
        "wait in — one report cannot tell that from a rank on its way")
    return Conclusion(Verdict.HANG, culprits, CulpritBasis.LAUNCH_COUNTS, Certainty.UNCERTAIN,
                      summary,
                      Advice("Take a second report a few seconds later (`ncclras -f json > "
                             "b.json`) and give both (`--ras a.json --ras b.json`): counts "
                             "that stayed name the rank that never launched."))


def ras_nothing_wrong(f: Facts) -> bool:
    """RAS alone (no rank's own evidence), one report, nothing wrong in it."""
    ras = ras_of(f)
    return (ras is not None and not f.views and not ras.compared
            and not ras.comparison.findings)


def ras_one_poll_clean(f: Facts) -> Conclusion:
    return Conclusion(
        Verdict.INCONCLUSIVE, [], CulpritBasis.NONE, Certainty.UNCERTAIN,
        with_launch_caveat("One RAS report, every rank RUNNING with equal launch counts and "
                           "no error: nothing wrong in it, but one report cannot tell a "
                           "running job from a frozen one"),
        Advice("Take a second report a few seconds later and give both (`--ras a.json --ras "
               "b.json`), or the ranks' stacks (`moe-hang diagnose`)."))


# ----------------------------------------------------------------------------- moving


def ras_moving(f: Facts) -> bool:
    """Two polls: some communicator launched more, none froze with counts that disagree."""
    ras = ras_of(f)
    return (ras is not None and ras.compared
            and bool(ras.comparison.of(FindingKind.MOVING))
            and not ras.comparison.of(FindingKind.FROZEN_MISMATCH, FindingKind.LAGGING))


def ras_all_moving(f: Facts) -> Conclusion:
    """Healthy: likely, unless the ranks' own evidence saw them stuck (then uncertain: watch
    watches on rather than end a job NCCL says is launching)."""
    ras = ras_of(f)
    assert ras is not None
    moved = [p for p in ras.comparison.comms if p.progress == "moving"]
    when = f"in {ras.interval_s:.1f} s" if ras.interval_s is not None else "between the polls"
    stuck = sorted(f.waiting)
    summary = (f"NCCL launched more collectives {when} in {len(moved)} of "
               f"{len(ras.comparison.comms)} communicator(s) RAS reached: the job is moving, "
               "not hung")
    if stuck:
        summary += (f", though rank {spans(stuck)} showed no progress of its own while "
                    "sampled")
    return Conclusion(Verdict.HEALTHY, [], CulpritBasis.NONE,
                      Certainty.UNCERTAIN if stuck else Certainty.LIKELY,
                      with_launch_caveat(summary))
