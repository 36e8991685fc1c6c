"""Communicator ranks -> the job's global ranks, through the process each one lives in — pure.

RAS numbers ranks within each communicator; the job knows its processes by (host, pid) and
global rank (``processes.json``). RAS's host is the IP address of the process's RAS socket (the
bootstrap interface; it never resolves names), so a caller that knows hosts by name passes
``aliases`` (RAS's address -> the caller's name). A rank whose process RAS could not find (pid
-1, host "unknown") or the caller does not know is left out: unmapped, never guessed.
"""

from __future__ import annotations

from collections.abc import Mapping

from moe_hang.evidence.ras.records import RasCommunicator, RasMissingRank, RasRank, RasReport

ProcessKey = tuple[str, int]  # (host, pid)


def comm_global_ranks(comm: RasCommunicator, processes: Mapping[ProcessKey, int], *,
                      aliases: Mapping[str, str] | None = None) -> dict[int, int]:
    """Communicator rank -> global rank, for its live and missing ranks the caller knows."""
    out: dict[int, int] = {}
    members: list[RasRank | RasMissingRank] = [*comm.ranks, *comm.missing_ranks]
    for r in members:
        if r.pid < 0:
            continue
        host = (aliases or {}).get(r.host, r.host)
        g = processes.get((host, r.pid))
        if g is not None:
            out[r.rank] = g
    return out


def global_rank_maps(report: RasReport, processes: Mapping[ProcessKey, int], *,
                     aliases: Mapping[str, str] | None = None) -> dict[str, dict[int, int]]:
    """Per communicator (by :attr:`RasCommunicator.key`): comm rank -> global rank."""
    return {c.key: comm_global_ranks(c, processes, aliases=aliases)
            for c in report.communicators}
