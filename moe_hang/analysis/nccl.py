"""NCCL RAS read together with the rest of the evidence (pure): each rank's state and
per-communicator *launch* counts, across two polls. The rules of
:mod:`moe_hang.analysis.rules` read the facts and conclusions here (docs/DESIGN.md §13):

- a rank RAS considers dead or cannot reach: a process or its node is down (``rank_died``);
- an NCCL error (``async_error``, a failed init) or an aborted communicator on some ranks: the
  root cause on those ranks (``crash``);
- launch counts that disagree and stay frozen across two polls: the ranks behind never launched
  what the others wait in (``desync``), followed across communicators through the processes,
  and checked against the recorder and the stacks — a contradiction is said, and lowers the
  certainty;
- counts that moved: the job launches collectives (``healthy``);
- one report: counts that differ name a candidate, uncertainly; nothing wrong in it says
  nothing about frozen or moving.

The symmetric case — every rank in one collective, RAS frozen at equal counts, the recorder's
``started`` everywhere — is :mod:`moe_hang.analysis.transport`'s.

Every sentence built from counts carries the launch caveat (launches, not completions; no
send/recv, so no all-to-all): :func:`~moe_hang.evidence.ras.with_launch_caveat`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

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
from moe_hang.evidence.flight_recorder import Collective
from moe_hang.evidence.model import Evidence
from moe_hang.evidence.ras import (
    FindingKind,
    RasCommunicator,
    RasEvidence,
    RasFinding,
    RasReport,
    with_launch_caveat,
)
from moe_hang.evidence.ras import RankState as RasState
from moe_hang.evidence.ras.counts import ordinal
from moe_hang.evidence.stacks import Frame, callsite
from moe_hang.evidence.vocab import RankState, spans
from moe_hang.evidence.vocab import who as ranks_who

_REMOTE = "ncclRemoteError"

Proc = tuple[str, int]  # (RAS host, pid): one process, across communicators


# ----------------------------------------------------------------------------- naming


def ras_of(f: Facts) -> RasEvidence | None:
    """The RAS evidence of this diagnosis, when it holds a report."""
    ras = f.ev.ras
    return ras if ras is not None and ras.polls else None


def _comm(ras: RasEvidence, key: str) -> RasCommunicator | None:
    rep = ras.latest
    return next((c for c in rep.communicators if c.key == key), None) if rep else None


def _proc(c: RasCommunicator | None, rank: int) -> Proc | None:
    if c is None:
        return None
    members = [(r.rank, r.host, r.pid) for r in c.ranks] + \
        [(m.rank, m.host, m.pid) for m in c.missing_ranks]
    return next(((h, pid) for r, h, pid in members if r == rank and pid >= 0), None)


def _globals(ras: RasEvidence, key: str, ranks: tuple[int, ...]) -> list[int]:
    return sorted({g for r in ranks if (g := ras.global_rank(key, r)) is not None})


def _comm_name(c: RasCommunicator | None, key: str) -> str:
    if c is None:
        return f"communicator {key.split(':', 1)[0]}"
    return f"communicator {c.label + ' ' if c.label else ''}{c.hash} ({c.size} ranks)"


def _who(ras: RasEvidence, key: str, ranks: tuple[int, ...], n: int | None = None, *,
         short: bool = False) -> str:
    """``rank 3`` (global, as everywhere in the tool) where mapped, else ``communicator rank 1
    (process 7288 on 10.42.7.91)`` (``short``: without the processes); ``n``: how many the
    report counts when it names fewer."""
    g = _globals(ras, key, ranks)
    if ranks and len(g) == len(ranks):
        return ("rank " if len(g) == 1 else "ranks ") + spans(g)
    c = _comm(ras, key)
    if not ranks:
        return f"{n} ranks" if n else "ranks"
    procs = [] if short else [p for r in ranks if (p := _proc(c, r)) is not None]
    where = (" (" + ", ".join(f"process {pid} on {h}" for h, pid in procs[:3])
             + (", …" if len(procs) > 3 else "") + ")") if procs else ""
    more = f" of {n}" if n and n > len(ranks) else ""
    return (f"communicator rank{'s' if len(ranks) > 1 else ''} {spans(list(ranks))}"
            f"{more}{where}")


def cap(text: str) -> str:
    return text[:1].upper() + text[1:]


def _site(fr: Frame | None) -> str:
    return fr.short() if fr is not None else ""


# ----------------------------------------------------------------------------- dead ranks


@dataclass
class Gone:
    findings: list[RasFinding]
    culprits: list[int]  # global ranks (mapped)
    dead: bool  # RAS considers at least one dead (else: unreachable so far, or finalized)
    seen_alive: list[int]  # culprits the tool itself saw alive


def _left(ras: RasEvidence) -> list[RasFinding]:
    """Ranks that finalized or destroyed a communicator the others still hold RUNNING."""
    out = []
    for x in ras.comparison.of(FindingKind.FINALIZING):
        c = _comm(ras, x.comm)
        running = c is not None and (
            any(g.state == RasState.RUNNING for g in c.status_groups)
            or any(r.state == RasState.RUNNING for r in c.ranks))
        if c is not None and c.size and x.n_ranks < c.size and running:
            out.append(x)
    return out


def gone(f: Facts) -> Gone | None:
    """Ranks RAS considers dead or cannot reach, or that left a communicator the others still
    use, in the latest report."""
    ras = ras_of(f)
    if ras is None:
        return None
    found = list(ras.comparison.of(FindingKind.DEAD, FindingKind.UNRESPONSIVE)) + _left(ras)
    if not found:
        return None
    culprits = sorted({g for x in found for g in _globals(ras, x.comm, x.ranks)})
    alive = [g for g in culprits if g in f.views and f.views[g].ev.alive is True
             and f.views[g].state != RankState.EXITED]
    return Gone(found, culprits, any(x.kind == FindingKind.DEAD for x in found), alive)


def _missing(ras: RasEvidence, xs: list[RasFinding], mapped: bool) -> str:
    """``rank 2 (process 8802 on 192.168.50.12), in 2 communicators``."""
    names = list(dict.fromkeys(_who(ras, x.comm, x.ranks) for x in xs))
    details = list(dict.fromkeys(x.detail for x in xs if x.detail))
    comms = list(dict.fromkeys(x.comm for x in xs))
    text = ", ".join(names) + (f" ({'; '.join(details)})" if mapped and details else "")
    return text + (f", in {len(comms)} communicators" if len(comms) > 1 else
                   f" of {_comm_name(_comm(ras, comms[0]), comms[0])}")


def ras_rank_died(f: Facts) -> Conclusion:
    g = gone(f)
    ras = ras_of(f)
    assert g is not None and ras is not None
    dead = [x for x in g.findings if x.kind == FindingKind.DEAD]
    unreached = [x for x in g.findings if x.kind == FindingKind.UNRESPONSIVE]
    left = [x for x in g.findings if x.kind == FindingKind.FINALIZING]
    parts = []
    if dead:
        parts.append(f"RAS considers {_missing(ras, dead, bool(g.culprits))} dead: unreachable "
                     "over its network for 60 s — that process or its node is down")
    if unreached:
        parts.append(f"RAS cannot reach {_missing(ras, unreached, bool(g.culprits))}: its "
                     "process is stopped, gone or cut off (RAS declares it dead after 60 s)")
    if left:
        one = sum(x.n_ranks for x in left) == 1
        parts.append(f"{_missing(ras, left, bool(g.culprits))} called ncclCommFinalize or "
                     "ncclCommDestroy while the others still use the communicator: "
                     f"{'it' if one else 'they'} left early (finished the loop, or tore down "
                     "after an error)")
    summary = cap("; ".join(parts)) + ". The other ranks wait for it."
    certainty = Certainty.DEFINITE if g.dead else Certainty.LIKELY
    if g.seen_alive:
        summary += (f" The tool saw rank {spans(g.seen_alive)}'s process alive: RAS cannot "
                    "reach it, so suspect its node's network rather than the process.")
        certainty = Certainty.LIKELY
    where = "; ".join(dict.fromkeys(x.detail for x in dead + unreached
                                    if x.detail and "not found" not in x.detail))
    if left and not dead and not unreached:
        text = ("Make every rank run the same steps before it tears down (the same number of "
                "batches; destroy_process_group only after the last collective of every "
                "rank); if it tore down after an error, its log says which.")
    else:
        text = (f"Check {where or 'that process'}: whether it still runs (`ps -p PID` on that "
                "host), why it stopped (the OOM killer in `dmesg`, a GPU error — an Xid — in "
                "`nvidia-smi -q` or dmesg) and its node's network; the others only wait for "
                "it.")
    return Conclusion(Verdict.RANK_DIED, g.culprits, CulpritBasis.EXITED, certainty, summary,
                      Advice(text))


# ----------------------------------------------------------------------------- NCCL errors


@dataclass
class Errors:
    errors: list[RasFinding]
    aborts: list[RasFinding]
    culprits: list[int]
    remote_only: bool  # every error is ncclRemoteError: a peer or the network failed
    everywhere: bool  # every live rank of the communicator has it: it singles out nobody


def nccl_errors(f: Facts) -> Errors | None:
    """NCCL errors (``async_error``, a failed init) on some ranks, or communicators aborted
    (``abort_flag``) on some ranks while others are not."""
    ras = ras_of(f)
    if ras is None:
        return None
    errors = list(ras.comparison.of(FindingKind.RANK_ERROR))
    aborts = []
    for x in ras.comparison.of(FindingKind.ABORTED):
        c = _comm(ras, x.comm)
        live = len(c.ranks) if c is not None else 0
        if x.ranks and (not live or len(x.ranks) < live):
            aborts.append(x)  # aborted on every rank (a watchdog timeout everywhere): no one
    if not errors and not aborts:
        return None
    blamed = errors or aborts
    culprits = sorted({g for x in blamed for g in _globals(ras, x.comm, x.ranks)})
    everywhere = False
    for x in errors:
        c = _comm(ras, x.comm)
        if c is not None and c.ranks and len(x.ranks) >= len(c.ranks):
            everywhere = True
    remote = bool(errors) and all(_REMOTE in x.detail for x in errors)
    return Errors(errors, aborts, culprits, remote, everywhere)


_ERROR_ADVICE = {
    "ncclUnhandledCudaError": "a CUDA call failed under NCCL: check that GPU (`nvidia-smi -q`, "
                              "dmesg for an Xid) and NCCL_DEBUG=INFO's last lines there",
    "ncclSystemError": "a system call failed (sockets, shared memory, file limits): "
                       "NCCL_DEBUG=INFO on that host names it",
    "ncclInternalError": "NCCL failed internally: NCCL_DEBUG=INFO on that host says where",
    "ncclInvalidArgument": "that rank passed NCCL an invalid argument (a tensor's device, "
                           "size or dtype in its collective): NCCL_DEBUG=INFO says which",
    "ncclInvalidUsage": "that rank used NCCL in a way it refuses (e.g. a communicator used "
                        "after an error): NCCL_DEBUG=INFO says how",
    _REMOTE: "a remote error (ncclRemoteError) means a peer failed, or the network did, while "
             "that rank talked to it: NCCL_DEBUG=INFO on its host names the peer and the "
             "transport — check that peer's process and the link",
    "ncclTimeout": "an NCCL operation timed out there: NCCL_DEBUG=INFO on that host says "
                   "which",
}


def ras_rank_error(f: Facts) -> Conclusion:
    e = nccl_errors(f)
    ras = ras_of(f)
    assert e is not None and ras is not None
    parts = []
    for x in e.errors:
        parts.append(f"NCCL reports {x.detail} on {_who(ras, x.comm, x.ranks)} of "
                     f"{_comm_name(_comm(ras, x.comm), x.comm)}")
    for x in e.aborts:
        parts.append(f"{_who(ras, x.comm, x.ranks)}'s {_comm_name(_comm(ras, x.comm), x.comm)}"
                     " was aborted (abort_flag: torch aborts a communicator after an error or a "
                     "timeout on that rank)")
    summary = "; ".join(parts) + "."
    if e.errors and e.remote_only:
        summary += (" A remote error means a peer or the network failed: it surfaced here, "
                    "and may have started at that peer.")
        certainty = Certainty.LIKELY
    elif e.errors:
        certainty = Certainty.DEFINITE
    else:
        certainty = Certainty.LIKELY  # an abort alone: its reason is on that rank
    if e.everywhere:
        summary += " Every rank of that communicator reports it: it singles out no rank."
        certainty = Certainty.UNCERTAIN
    codes = [k for k in _ERROR_ADVICE if any(k in x.detail for x in e.errors)]
    hosts = sorted({p[0] for x in e.errors + e.aborts for r in x.ranks
                    if (p := _proc(_comm(ras, x.comm), r)) is not None})
    if codes:
        text = "; ".join(_ERROR_ADVICE[k] for k in codes[:2]) + (
            f" (its host: {', '.join(hosts[:3])})" if hosts else "") + "."
    else:
        text = ("Its own log says why its communicator was aborted (torch's watchdog logs the "
                "error or timeout before it aborts); NCCL_DEBUG=INFO on that host adds NCCL's "
                "side.")
    text = cap(text)
    return Conclusion(Verdict.CRASH, e.culprits, CulpritBasis.NCCL_ERROR, certainty, summary,
                      Advice(text))


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


def _behind(ras: RasEvidence, x: RasFinding) -> Behind:
    c = _comm(ras, x.comm)
    return Behind(x, [p for r in x.ranks if (p := _proc(c, r)) is not None],
                  [p for r in x.ahead_ranks if (p := _proc(c, r)) is not None])


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
    culprits = sorted({g for b in causes for g in _globals(ras, b.finding.comm,
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


def _reconcile(f: Facts, ras: RasEvidence, m: FrozenMismatch) -> None:
    """What the recorder and the stacks say of the ranks behind: agreeing, or not."""
    x = m.primary.finding
    ahead = _globals(ras, x.comm, x.ahead_ranks)
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
                           + (f" at {_site(v.site)}" if v.site else ""))
        elif v.state == RankState.IN_COLLECTIVE and v.stack.op:
            m.agree.append(f"rank {g} waits in {v.stack.op}"
                           + (f" at {_site(v.site)}" if v.site else ""))
        elif v.site is not None:
            m.agree.append(f"rank {g} is at {_site(v.site)}")
    # the recorder, for the first cause: the group with that communicator's members
    behind = _globals(ras, x.comm, x.ranks)
    members = set(_globals(ras, x.comm, tuple(range(x.comm_size)))) if x.comm_size else set()
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


def _ahead(ras: RasEvidence, x: RasFinding) -> str:
    if x.ahead_ranks:
        return _who(ras, x.comm, x.ahead_ranks)
    return f"the other {x.comm_size - x.n_ranks}" if x.comm_size > x.n_ranks else "the others"


def ras_desync(f: Facts) -> Conclusion:
    m = frozen_mismatch(f)
    ras = ras_of(f)
    assert m is not None and ras is not None
    x = m.primary.finding
    c = _comm(ras, x.comm)
    who = _who(ras, x.comm, x.ranks, x.n_ranks)
    when = f"in {ras.interval_s:.1f} s" if ras.interval_s is not None else "between the polls"
    line = f" (at {_site(m.line)})" if m.line is not None else ""
    summary = with_launch_caveat(
        f"{cap(who)} never launched the {_missed(x)} {x.op} of {_comm_name(c, x.comm)} "
        f"that {_ahead(ras, x)} launched{line}, and no rank launched anything there {when}: "
        f"it cannot complete without {'it' if x.n_ranks == 1 else 'them'}")
    for b in m.causes[1:]:
        y = b.finding
        summary += (f" {cap(_who(ras, y.comm, y.ranks, y.n_ranks))} never launched the "
                    f"{_missed(y)} {y.op} of {_comm_name(_comm(ras, y.comm), y.comm)} that "
                    f"{_ahead(ras, y)} launched.")
    if m.cycle:
        summary += (" Every rank behind is ahead in another communicator: they wait for each "
                    "other (communicators launched in different orders), and the counts do "
                    "not say who began it — their stacks would.")
    elif m.chain:
        held = sorted({g for b in m.chain for g in _globals(ras, b.finding.comm,
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
              else _who(ras, x.comm, x.ranks, x.n_ranks, short=True))
    now = next((f.views[g] for g in m.culprits if g in f.views and f.views[g].site), None)
    proc = _proc(c, x.ranks[0]) if x.ranks else None
    where = (f"it is at {_site(now.site)} instead" if now is not None and now.site
             else f"`py-spy dump --pid {proc[1]}` on {proc[0]} says where it is instead"
             if proc is not None else "its stack says where it is instead")
    text = (f"Find why {target} did not reach the {x.op} the others launched"
            + (f" ({_site(m.line)})" if m.line is not None else "")
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
    c = _comm(ras, x.comm)
    culprits = sorted({g for y in found for g in _globals(ras, y.comm, y.ranks)})
    summary = with_launch_caveat(
        f"In one RAS report {_who(ras, x.comm, x.ranks, x.n_ranks)} had launched the {x.op} "
        f"of {_comm_name(c, x.comm)} {x.count} times, {_ahead(ras, x)} {x.ahead} times: if "
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


# ----------------------------------------------------------------------------- JSON and lines


def ras_lines(ev: Evidence) -> list[str]:
    """The diagnosis's evidence lines from RAS (none without a report)."""
    return ev.ras.lines() if ev.ras is not None else []


def ras_summary(ev: Evidence) -> dict[str, Any] | None:
    """``nccl_ras`` of the diagnosis JSON: the polls, whether they were compared, how ranks
    were mapped, and every finding (kind, communicator, ranks, global ranks, counts)."""
    ras = ev.ras
    if ras is None:
        return None
    rep: RasReport | None = ras.latest
    return {
        "polls": [p.source for p in ras.polls], "compared": ras.compared,
        "interval_s": ras.interval_s, "nccl_version": rep.nccl_version if rep else None,
        "mapped_by": ras.mapped_by or None, "notes": ras.notes,
        "findings": [{"kind": x.kind.value, "comm": x.comm_hash, "comm_size": x.comm_size,
                      "ranks": list(x.ranks), "global_ranks": list(x.global_ranks),
                      **({"op": x.op, "count": x.count, "ahead": x.ahead,
                          "ahead_ranks": list(x.ahead_ranks)} if x.op else {}),
                      "sentence": x.sentence} for x in ras.comparison.findings],
    }
