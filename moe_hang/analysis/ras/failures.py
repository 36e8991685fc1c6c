"""RAS's word on ranks that are gone or failed (pure): a rank RAS considers dead or cannot
reach, or that left a communicator the others still run (``rank_died``); an NCCL error or an
aborted communicator on some ranks, the root cause there (``crash``) (docs/DESIGN.md §13)."""

from __future__ import annotations

from dataclasses import dataclass

from moe_hang.analysis.advice import Advice
from moe_hang.analysis.conclusion import Conclusion
from moe_hang.analysis.diagnosis import Certainty, CulpritBasis, Verdict
from moe_hang.analysis.facts import Facts
from moe_hang.analysis.ras.common import (
    cap,
    comm_name,
    comm_of,
    global_ranks_of,
    proc_of,
    ras_of,
    who_in,
)
from moe_hang.analysis.ras.findings import FindingKind, RasFinding
from moe_hang.analysis.ras.reading import RasReading
from moe_hang.evidence.ras import RankState as RasState
from moe_hang.evidence.vocab import RankState, spans

_REMOTE = "ncclRemoteError"


# ----------------------------------------------------------------------------- dead ranks


@dataclass
class Gone:
    findings: list[RasFinding]
    culprits: list[int]  # global ranks (mapped)
    dead: bool  # RAS considers at least one dead (else: unreachable so far, or finalized)
    seen_alive: list[int]  # culprits the tool itself saw alive


def _left(ras: RasReading) -> list[RasFinding]:
    """Ranks that finalized or destroyed a communicator the others still hold RUNNING."""
    out = []
    for x in ras.comparison.of(FindingKind.FINALIZING):
        c = comm_of(ras, x.comm)
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
    culprits = sorted({g for x in found for g in global_ranks_of(ras, x.comm, x.ranks)})
    alive = [g for g in culprits if g in f.views and f.views[g].ev.alive is True
             and f.views[g].state != RankState.EXITED]
    return Gone(found, culprits, any(x.kind == FindingKind.DEAD for x in found), alive)


def _missing(ras: RasReading, xs: list[RasFinding], mapped: bool) -> str:
    """``rank 2 (process 8802 on 192.168.50.12), in 2 communicators``."""
    names = list(dict.fromkeys(who_in(ras, x.comm, x.ranks) for x in xs))
    details = list(dict.fromkeys(x.detail for x in xs if x.detail))
    comms = list(dict.fromkeys(x.comm for x in xs))
    text = ", ".join(names) + (f" ({'; '.join(details)})" if mapped and details else "")
    return text + (f", in {len(comms)} communicators" if len(comms) > 1 else
                   f" of {comm_name(comm_of(ras, comms[0]), comms[0])}")


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
        c = comm_of(ras, x.comm)
        live = len(c.ranks) if c is not None else 0
        if x.ranks and (not live or len(x.ranks) < live):
            aborts.append(x)  # aborted on every rank (a watchdog timeout everywhere): no one
    if not errors and not aborts:
        return None
    blamed = errors or aborts
    culprits = sorted({g for x in blamed for g in global_ranks_of(ras, x.comm, x.ranks)})
    everywhere = False
    for x in errors:
        c = comm_of(ras, x.comm)
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
        parts.append(f"NCCL reports {x.detail} on {who_in(ras, x.comm, x.ranks)} of "
                     f"{comm_name(comm_of(ras, x.comm), x.comm)}")
    for x in e.aborts:
        parts.append(f"{who_in(ras, x.comm, x.ranks)}'s {comm_name(comm_of(ras, x.comm), x.comm)}"
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
                    if (p := proc_of(comm_of(ras, x.comm), r)) is not None})
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
