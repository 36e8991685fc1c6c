"""How the RAS findings of a diagnosis name communicators, processes and ranks — pure: a
rank by its global number where the communicator's ranks are mapped, else by its communicator
rank and process (:func:`who_in`)."""

from __future__ import annotations

from moe_hang.analysis.facts import Facts
from moe_hang.analysis.ras.reading import RasReading
from moe_hang.evidence.ras import RasCommunicator
from moe_hang.evidence.stacks import Frame
from moe_hang.evidence.vocab import spans

Proc = tuple[str, int]  # (RAS host, pid): one process, across communicators


def ras_of(f: Facts) -> RasReading | None:
    """What the RAS reports of this diagnosis say, when it holds one."""
    return f.ras if f.ras is not None and f.ras.polls else None


def comm_of(ras: RasReading, key: str) -> RasCommunicator | None:
    rep = ras.latest
    return next((c for c in rep.communicators if c.key == key), None) if rep else None


def proc_of(c: RasCommunicator | None, rank: int) -> Proc | None:
    if c is None:
        return None
    members = [(r.rank, r.host, r.pid) for r in c.ranks] + \
        [(m.rank, m.host, m.pid) for m in c.missing_ranks]
    return next(((h, pid) for r, h, pid in members if r == rank and pid >= 0), None)


def global_ranks_of(ras: RasReading, key: str, ranks: tuple[int, ...]) -> list[int]:
    return sorted({g for r in ranks if (g := ras.global_rank(key, r)) is not None})


def comm_name(c: RasCommunicator | None, key: str) -> str:
    if c is None:
        return f"communicator {key.split(':', 1)[0]}"
    return f"communicator {c.label + ' ' if c.label else ''}{c.hash} ({c.size} ranks)"


def who_in(ras: RasReading, key: str, ranks: tuple[int, ...], n: int | None = None, *,
         short: bool = False) -> str:
    """``rank 3`` (global, as everywhere in the tool) where mapped, else ``communicator rank 1
    (process 7288 on 10.42.7.91)`` (``short``: without the processes); ``n``: how many the
    report counts when it names fewer."""
    g = global_ranks_of(ras, key, ranks)
    if ranks and len(g) == len(ranks):
        return ("rank " if len(g) == 1 else "ranks ") + spans(g)
    c = comm_of(ras, key)
    if not ranks:
        return f"{n} ranks" if n else "ranks"
    procs = [] if short else [p for r in ranks if (p := proc_of(c, r)) is not None]
    where = (" (" + ", ".join(f"process {pid} on {h}" for h, pid in procs[:3])
             + (", …" if len(procs) > 3 else "") + ")") if procs else ""
    more = f" of {n}" if n and n > len(ranks) else ""
    return (f"communicator rank{'s' if len(ranks) > 1 else ''} {spans(list(ranks))}"
            f"{more}{where}")


def cap(text: str) -> str:
    return text[:1].upper() + text[1:]


def site_text(fr: Frame | None) -> str:
    return fr.short() if fr is not None else ""
