"""Findings from one report's rank states: dead, unresponsive and non-member ranks, NCCL
errors, aborts, finalizing and initializing ranks — pure (no counts: no launch caveat)."""

from __future__ import annotations

from moe_hang.analysis.ras.findings import FindingKind, Namer, RasFinding
from moe_hang.evidence.ras.records import (
    NCCL_IN_PROGRESS,
    RankState,
    RasCommunicator,
    RasMissingRank,
)


def _processes(ms: list[RasMissingRank]) -> str:
    return ", ".join(f"process {m.pid} on {m.host}" if m.pid >= 0 else "process not found"
                     for m in ms)


def _missing(c: RasCommunicator, n: Namer) -> list[RasFinding]:
    out = []
    dead = [m for m in c.missing_ranks if m.considered_dead]
    gone = [m for m in c.missing_ranks if m.unresponsive and not m.considered_dead]
    other = [m for m in c.missing_ranks if not m.unresponsive and not m.considered_dead]
    name = n.comm(c)
    if dead:
        rs = tuple(m.rank for m in dead)
        out.append(n.finding(FindingKind.DEAD, c, rs, (
            f"RAS considers {n.who(c, rs)} of {name} dead ({_processes(dead)}): unreachable "
            "over the RAS network for 60 s, so RAS stopped trying."), detail=_processes(dead)))
    if gone:
        rs = tuple(m.rank for m in gone)
        out.append(n.finding(FindingKind.UNRESPONSIVE, c, rs, (
            f"RAS could not reach {n.who(c, rs)} of {name} ({_processes(gone)}): the process "
            "is stopped, gone or cut off; RAS declares it dead after 60 s."),
            detail=_processes(gone)))
    if other:
        rs = tuple(m.rank for m in other)
        out.append(n.finding(FindingKind.NOT_MEMBER, c, rs, (
            f"{_cap(n.who(c, rs))} of {name} answered RAS but "
            f"{'is' if len(rs) == 1 else 'are'} not in the communicator: not yet created "
            "there, or already destroyed."), detail=_processes(other)))
    return out


def _cap(text: str) -> str:
    return text[:1].upper() + text[1:]


def _state_ranks(c: RasCommunicator) -> dict[RankState, list[int]]:
    """Ranks by state; JSON's init errors are not INIT (they are errors), and a state the text
    report counts without naming a rank is there with no ranks."""
    out: dict[RankState, list[int]] = {}
    for r in c.ranks:
        if r.flags is None:
            if r.state_hint is not None:
                out.setdefault(r.state_hint, []).append(r.rank)
        elif r.flags.state is not RankState.INIT or r.flags.init_state == NCCL_IN_PROGRESS:
            out.setdefault(r.flags.state, []).append(r.rank)
    for g in c.status_groups:
        out.setdefault(g.state, [])
    return out


_STATE_WORDS = {
    RankState.ABORT: (FindingKind.ABORTED, "aborted it (abort_flag: ncclCommAbort, as torch's "
                      "watchdog does after a timeout or an error)"),
    RankState.FINALIZE: (FindingKind.FINALIZING, "called ncclCommFinalize or ncclCommDestroy "
                         "on it (finalize_called/destroy_flag)"),
    RankState.INIT: (FindingKind.INITIALIZING, "had not finished creating it (init_state "
                     "ncclInProgress)"),
    # the text report only: processes that answered without this communicator (NOCOMM;
    # UNKNOWN before 2.26)
    RankState.NOCOMM: (FindingKind.NOT_MEMBER, "answered RAS without it: not yet created "
                       "there, or already destroyed"),
    RankState.UNKNOWN: (FindingKind.NOT_MEMBER, "answered RAS without it: not yet created "
                        "there, or already destroyed"),
}


def _live(c: RasCommunicator, n: Namer) -> list[RasFinding]:
    out = []
    name = n.comm(c)
    errors: dict[str, list[int]] = {}
    for r in c.ranks:
        if r.flags is not None and (err := r.flags.error):
            errors.setdefault(err, []).append(r.rank)
    for err, rs in errors.items():
        t = tuple(rs)
        out.append(n.finding(FindingKind.RANK_ERROR, c, t,
                             f"{_cap(n.who(c, t))} of {name} reports {err}.", detail=err))
    if c.errors:  # text: the ERROR block's own lines
        t = c.error_ranks
        text = "; ".join(c.errors)
        subject = _cap(n.who(c, t)) if t else "Ranks"
        out.append(n.finding(FindingKind.RANK_ERROR, c, t, f"{subject} of {name}: {text}.",
                             detail=text))
    states = _state_ranks(c)
    for state, (kind, words) in _STATE_WORDS.items():
        if state in states:
            t = tuple(states[state])
            counted = next((g.n_ranks for g in c.status_groups if g.state is state), len(t))
            subject = _cap(n.who(c, t)) if t else f"{counted} ranks"
            out.append(n.finding(kind, c, t, f"{subject} of {name} {words}.",
                                 n_ranks=max(counted, len(t)), detail=state.value))
    return out


def state_findings(c: RasCommunicator, n: Namer) -> list[RasFinding]:
    """What one communicator's ranks' states say, in the latest report."""
    return _missing(c, n) + _live(c, n)
