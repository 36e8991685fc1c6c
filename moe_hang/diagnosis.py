"""The verdict data model and its JSON form (``moe-hang/diagnosis/v1``, DESIGN §4). Pure."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SCHEMA = "moe-hang/diagnosis/v1"
VERDICTS = ("desync", "hang", "crash", "rank_died", "straggler", "healthy", "inconclusive")
STATES = ("in_collective", "computing", "idle", "exited", "unknown")
KINDS = ("op_mismatch", "size_mismatch", "dtype_mismatch", "missing_rank")

# Exit codes (DESIGN §3).
EXIT_OK = 0
EXIT_TOOL_ERROR = 1
EXIT_USAGE = 2
EXIT_PROBLEM = 3
EXIT_VERIFY_FAILED = 4

# Verdicts that are not a problem: a straggler is slow, not deadlocked.
NO_PROBLEM = ("healthy", "straggler")
PROBLEM_VERDICTS = ("desync", "hang", "crash", "rank_died")


def exit_code_for(verdict: str) -> int:
    """A diagnosis's exit code (DESIGN §3): 3 unless the job is fine. An inconclusive
    diagnosis is 3 too: a script must not read "could not tell" as "healthy"."""
    return EXIT_OK if verdict in NO_PROBLEM else EXIT_PROBLEM


DEFAULT_PG = "0"  # the default process group's name in Flight Recorder and the probe


def fmt_shape(sizes: list[list[int]]) -> str:
    """Tensor sizes for a person: ``68×64, scalar``; empty when there are none."""
    return ", ".join("×".join(map(str, s)) or "scalar" for s in sizes)


def pg_label(pg: str | None, desc: str | None = "", *, word: str = "group") -> str:
    """A process group for a person: its description, else ``default_pg``, else ``group N``
    (``word`` replaces "group")."""
    if desc:
        return desc
    return "default_pg" if pg == DEFAULT_PG else f"{word} {pg}"


@dataclass
class RankCollective:
    op: str
    pg: str
    seq: int | None
    input_sizes: list[list[int]] = field(default_factory=list)
    dtypes: list[str] = field(default_factory=list)
    source: str = "flight_recorder"
    pg_desc: str = ""
    time_created_ns: int | None = None
    tag: str | None = None  # which logical collective (e.g. layer1.expert2), from the probe
    callsite: dict[str, Any] | None = None  # the line that posted this collective

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"op": self.op, "pg": self.pg, "seq": self.seq,
                             "input_sizes": self.input_sizes}
        if self.tag:
            d["tag"] = self.tag
        if self.callsite:
            d["callsite"] = self.callsite
        if self.dtypes:
            d["dtypes"] = self.dtypes
        if self.pg_desc:
            d["pg_desc"] = self.pg_desc
        d["source"] = self.source
        return d


@dataclass
class RankReport:
    rank: int
    pid: int | None = None
    host: str | None = None
    state: str = "unknown"
    collective: RankCollective | None = None
    callsite: dict[str, Any] | None = None
    tokens: dict[str, Any] | None = None
    exit_code: int | None = None
    phase: str | None = None  # forward | backward
    autograd_function: str | None = None
    stack: list[str] = field(default_factory=list)  # short frames, innermost first
    stack_source: str | None = None
    note: str | None = None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "rank": self.rank, "pid": self.pid, "host": self.host, "state": self.state,
            "collective": self.collective.to_dict() if self.collective else None,
            "callsite": self.callsite, "tokens": self.tokens, "exit_code": self.exit_code,
        }
        if self.phase:
            d["phase"] = self.phase
        if self.autograd_function:
            d["autograd_function"] = self.autograd_function
        if self.stack:
            d["stack"] = self.stack
        if self.stack_source:
            d["stack_source"] = self.stack_source
        if self.note:
            d["note"] = self.note
        return d


@dataclass
class Divergence:
    pg: str
    seq: int | None  # None when only stacks were available
    kind: str
    pg_desc: str = ""
    members: list[int] = field(default_factory=list)
    per_rank: dict[int, RankCollective | None] = field(default_factory=dict)
    phase: str | None = None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"pg": self.pg, "seq": self.seq, "kind": self.kind}
        if self.pg_desc:
            d["pg_desc"] = self.pg_desc
        if self.members:
            d["ranks"] = self.members
        if self.phase:
            d["phase"] = self.phase
        d["per_rank"] = {str(r): (c.to_dict() if c else None)
                         for r, c in sorted(self.per_rank.items())}
        return d


@dataclass
class Diagnosis:
    verdict: str
    summary: str
    culprit_ranks: list[int] = field(default_factory=list)
    first_divergence: Divergence | None = None
    ranks: list[RankReport] = field(default_factory=list)
    fix: str = ""
    artifacts: str = ""
    evidence: list[str] = field(default_factory=list)
    timeline: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "schema": SCHEMA,
            "verdict": self.verdict,
            "summary": self.summary,
            "culprit_ranks": sorted(self.culprit_ranks),
            "first_divergence": self.first_divergence.to_dict() if self.first_divergence else None,
            "ranks": [r.to_dict() for r in sorted(self.ranks, key=lambda r: r.rank)],
            "fix": self.fix,
            "artifacts": self.artifacts,
            "evidence": self.evidence,
        }
        if self.timeline is not None:
            d["timeline"] = self.timeline
        d.update(self.extra)
        return d
