"""torch's own Flight Recorder dumps, after the fact: find the files a PATH names, load a set
of them on every core, and turn it into post-mortem :class:`Evidence` (pure: no torch).

A PATH is a directory of dumps, a prefix (``/tmp/nccl_trace_rank_``,
``~/.cache/torch/comm_lib_trace_rank_``) or one file. torch names a dump prefix + *global*
rank (the dump itself stores no rank and no host); JSON dumps are our ``.json`` convention
(torch writes JSON to no file). Within a directory every prefix is its own set.

Loading streams rank by rank: each worker process holds one parsed file at a time and sends
back only its window (:func:`.parse.parse_dump` with ``context``); the
48 KB world rank list every dump repeats at 8192 ranks crosses the pipe once per chunk and is
shared by every rank's record in the parent.
"""

from __future__ import annotations

from moe_hang.evidence.flight_recorder.find import DumpFile, DumpSet, Found, Problem, find
from moe_hang.evidence.flight_recorder.load_sets import (
    POOL_MIN_BYTES,
    POOL_MIN_FILES,
    LoadedSet,
    load_sets,
)
from moe_hang.evidence.model import Evidence, RankEvidence
from moe_hang.evidence.vocab import JobState

# finding is find's job and loading load_sets's; this module turns what was loaded into
# evidence, and is where the rest of the package imports all three from
__all__ = [
    "NO_DUMP_NOTE",
    "POOL_MIN_BYTES",
    "POOL_MIN_FILES",
    "DumpFile",
    "DumpSet",
    "Found",
    "LoadedSet",
    "Problem",
    "conflicting_groups",
    "evidence",
    "find",
    "group_ranks",
    "load_sets",
    "merge",
    "world_size",
]

NO_DUMP_NOTE = "no Flight Recorder dump for this rank"


def world_size(sets: list[LoadedSet]) -> int:
    """From every dump's groups (NCCL lists the whole default group), the highest rank in a
    group and the file numbering; each distinct rank list is looked at once."""
    w = 0
    seen: set[int] = set()
    for ls in sets:
        if ls.dumps.files:
            w = max(w, max(ls.dumps.files) + 1)
        for d in ls.fr.values():
            for members in d.pg_ranks.values():
                if id(members) in seen or not members:
                    continue
                seen.add(id(members))
                w = max(w, max(members) + 1, len(members))
    return w


def _set_line(ls: LoadedSet) -> str:
    vs = ", ".join(sorted(v or "?" for v in ls.versions())) or "?"
    bs = ", ".join(sorted(ls.backends())) or "?"
    line = (f"Flight Recorder dumps {ls.dumps.label}: {len(ls.fr)} read (format {vs}, {bs})")
    if len(ls.versions()) > 1:
        line += "; mixed format versions: files from different torch builds"
    return line


def evidence(sets: list[LoadedSet], *, world: int | None = None,
             extra: list[Problem] | None = None) -> Evidence:
    """Post-mortem evidence (the contract with the verdict engine): dumps written at a
    timeout mean every rank that dumped was stuck (alive, not progressing, no stack); a rank
    of the world with no dump is unknown, named as missing."""
    ranks: dict[int, RankEvidence] = {}
    lines: list[str] = []
    for ls in sets:
        lines.append(_set_line(ls))
        for r, d in sorted(ls.fr.items()):
            if r not in ranks:
                ranks[r] = RankEvidence(rank=r, fr=d, alive=True, progressed=False)
        for pb in ls.problems:
            if pb.rank is not None and pb.rank not in ranks:
                ranks[pb.rank] = RankEvidence(rank=pb.rank, alive=None,
                                              fr_error=f"{pb.path.name}: {pb.reason}")
            else:
                lines.append(pb.line())
    lines.extend(pb.line() for pb in extra or [])
    w = max(world or 0, world_size(sets))
    for r in range(w):
        if r not in ranks:
            ranks[r] = RankEvidence(rank=r, alive=None, notes=[NO_DUMP_NOTE])
    return Evidence(ranks=dict(sorted(ranks.items())), world_size=w or None, job=JobState.TIMED_OUT,
                    log_lines=lines, artifacts=", ".join(ls.dumps.label for ls in sets))


def group_ranks(ls: LoadedSet) -> dict[str, tuple[int, ...]]:
    """Every group's members as this set's dumps list them (one list per distinct group)."""
    out: dict[str, tuple[int, ...]] = {}
    for d in ls.fr.values():
        for pg, members in d.pg_ranks.items():
            out.setdefault(pg, members)
    return out


def conflicting_groups(ls: LoadedSet) -> list[str]:
    """Groups whose member list differs between two dumps of one set."""
    first: dict[str, tuple[int, ...]] = {}
    bad: list[str] = []
    for d in ls.fr.values():
        for pg, members in d.pg_ranks.items():
            old = first.setdefault(pg, members)
            if old is not members and old != members and pg not in bad:
                bad.append(pg)
    return bad


def merge(captured: Evidence, dumped: Evidence) -> Evidence:
    """Captures (moe-hang run directories) and dumps of one job: a rank a capture holds keeps
    its capture (stacks, heartbeat, host, liveness) and gains the dump when it has no recorder
    data of its own; the others come from the dumps. The job state is the capture's."""
    ranks = dict(captured.ranks)
    for r, d in dumped.ranks.items():
        have = ranks.get(r)
        if have is None:
            ranks[r] = d
        elif have.fr is None and d.fr is not None:
            have.fr = d.fr
            if d.fr.source is not None:
                have.notes.append(f"Flight Recorder dump from {d.fr.source}")
            # what the capture did not measure, the dump's timeout says: stuck, not moving
            have.alive = d.alive if have.alive is None else have.alive
            have.progressed = d.progressed if have.progressed is None else have.progressed
    worlds = [w for w in (captured.world_size, dumped.world_size) if w]
    return Evidence(
        ranks=dict(sorted(ranks.items())), world_size=max(worlds) if worlds else None,
        job=captured.job, job_exit_code=captured.job_exit_code,
        agent_exit_code=captured.agent_exit_code, root_cause_rank=captured.root_cause_rank,
        log_lines=[*captured.log_lines, *dumped.log_lines],
        artifacts=", ".join(a for a in (captured.artifacts, dumped.artifacts) if a),
        size_abort=captured.size_abort)
