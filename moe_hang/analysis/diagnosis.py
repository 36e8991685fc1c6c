"""The verdict data model and its JSON form (``moe-hang/diagnosis/v1``, docs/DESIGN.md §5).
Pure.

Verdicts, rank states and mismatch kinds are ``str`` enums: they compare equal to their JSON
spelling and serialise as it, so the JSON is what it always was.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from moe_hang.analysis.routing import RoutingReport, routing_sentence
from moe_hang.errors import EXIT_OK, EXIT_PROBLEM
from moe_hang.evidence.flight_recorder import DEFAULT_PG
from moe_hang.evidence.stacks import Frame
from moe_hang.evidence.vocab import RankState, StrEnum

if TYPE_CHECKING:
    from moe_hang.analysis.runs import RunInfo, Timings

SCHEMA = "moe-hang/diagnosis/v1"


class Verdict(StrEnum):
    DESYNC = "desync"
    HANG = "hang"
    CRASH = "crash"
    RANK_DIED = "rank_died"
    STRAGGLER = "straggler"
    HEALTHY = "healthy"
    INCONCLUSIVE = "inconclusive"
    # every rank in the same collective, posted alike, and it never completes (NCCL): the
    # transport or a GPU, never the collective order (analysis/ras/)
    TRANSPORT_HANG = "transport_hang"


class MismatchKind(StrEnum):
    OP = "op_mismatch"
    SIZE = "size_mismatch"
    DTYPE = "dtype_mismatch"
    MISSING = "missing_rank"
    ORDER = "order_mismatch"  # the same collectives, posted in different orders (a cycle)
    EXTRA = "extra_collective"  # collectives some ranks posted and the others never did


class CulpritBasis(StrEnum):
    """What the culprit follows from (docs/DESIGN.md §8)."""

    EXCEPTION = "exception"  # it raised the earliest exception that is not a consequence
    EXITED = "exited"  # it died, was killed, or left while the others wait for it
    MAJORITY = "majority"  # the minority at the divergence
    PROGRAM_ORDER = "program_order"  # further along the same code: it skipped what others wait in
    HISTORY = "history"  # earlier iterations show the order it broke
    CYCLE = "cycle"  # every rank on a wait-for cycle
    SOURCE = "source"  # the source runs the code only on these ranks (a rank condition)
    WAITED_FOR = "waited_for"  # outside any collective while the others wait for it
    AMBIGUOUS = "ambiguous"  # the evidence does not decide: every candidate is named
    # two threads of every rank post on one group: the order is each rank's timing
    THREAD_ORDER = "thread_order"
    NONE = "none"  # no culprit (healthy, or nothing to blame)
    # NCCL's own evidence (analysis/ras/)
    NCCL_ERROR = "nccl_error"  # NCCL reports an error or an abort on it (RAS)
    LAUNCH_COUNTS = "launch_counts"  # it never launched what the others launched (RAS)
    KERNEL_TIMING = "kernel_timing"  # its kernel started last, or never (the recorder's timing)


class Certainty(StrEnum):
    """How sure the verdict is; ``watch`` ends a job only on ``definite``."""

    DEFINITE = "definite"
    LIKELY = "likely"
    UNCERTAIN = "uncertain"


VERDICTS = tuple(v.value for v in Verdict)
STATES = tuple(s.value for s in RankState)
KINDS = tuple(k.value for k in MismatchKind)

# Verdicts that are not a problem: a straggler is slow, not deadlocked.
NO_PROBLEM = (Verdict.HEALTHY, Verdict.STRAGGLER)
PROBLEM_VERDICTS = (Verdict.DESYNC, Verdict.HANG, Verdict.CRASH, Verdict.RANK_DIED,
                    Verdict.TRANSPORT_HANG)


def exit_code_for(verdict: str) -> int:
    """A diagnosis's exit code (docs/DESIGN.md §4): 3 unless the job is fine. An inconclusive
    diagnosis is 3 too: a script must not read "could not tell" as "healthy"."""
    return EXIT_OK if verdict in NO_PROBLEM else EXIT_PROBLEM


def fmt_shape(sizes: list[list[int]]) -> str:
    """Tensor sizes for a person: ``68×64, scalar``; empty when there are none."""
    return ", ".join("×".join(map(str, s)) or "scalar" for s in sizes)


def pg_label(pg: str | None, desc: str | None = "", *, word: str = "group") -> str:
    """A process group for a person: its description, else ``default_pg``, else ``group N``
    (``word`` replaces "group")."""
    if desc and desc != "undefined":  # gloo's new_group without a description says so
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
    callsite: Frame | None = None  # the user line that posted this collective
    state: str | None = None  # the recorder's: scheduled | started (its kernel ran) | completed

    @property
    def from_stack_only(self) -> bool:
        return self.pg == "?"

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"op": self.op, "pg": self.pg, "seq": self.seq,
                             "input_sizes": self.input_sizes}
        if self.tag:
            d["tag"] = self.tag
        if self.callsite:
            d["callsite"] = self.callsite.as_dict()
        if self.dtypes:
            d["dtypes"] = self.dtypes
        if self.pg_desc:
            d["pg_desc"] = self.pg_desc
        if self.state:
            d["state"] = self.state
        d["source"] = self.source
        return d

    @classmethod
    def from_dict(cls, d: Any) -> RankCollective | None:
        if not isinstance(d, dict):
            return None
        return cls(op=str(d.get("op", "?")), pg=str(d.get("pg", "?")),
                   seq=None if d.get("seq") is None else int(d["seq"]),
                   input_sizes=[list(x) for x in d.get("input_sizes") or []],
                   dtypes=[str(x) for x in d.get("dtypes") or []],
                   source=str(d.get("source", "")), pg_desc=str(d.get("pg_desc", "")),
                   tag=d.get("tag"), callsite=Frame.from_dict(d.get("callsite")),
                   state=d.get("state"))


@dataclass
class RankReport:
    rank: int
    pid: int | None = None
    host: str | None = None
    state: RankState = RankState.UNKNOWN
    collective: RankCollective | None = None
    callsite: Frame | None = None
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
            "callsite": self.callsite.as_dict() if self.callsite else None,
            "tokens": self.tokens, "exit_code": self.exit_code,
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

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RankReport:
        return cls(rank=int(d["rank"]), pid=d.get("pid"), host=d.get("host"),
                   state=RankState.parse(d.get("state", RankState.UNKNOWN)),
                   collective=RankCollective.from_dict(d.get("collective")),
                   callsite=Frame.from_dict(d.get("callsite")), tokens=d.get("tokens"),
                   exit_code=d.get("exit_code"), phase=d.get("phase"),
                   autograd_function=d.get("autograd_function"),
                   stack=[str(x) for x in d.get("stack") or []],
                   stack_source=d.get("stack_source"), note=d.get("note"))


@dataclass
class Divergence:
    pg: str
    seq: int | None  # None when only stacks were available
    kind: MismatchKind
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

    @classmethod
    def from_dict(cls, d: Any) -> Divergence | None:
        if not isinstance(d, dict):
            return None
        return cls(pg=str(d.get("pg", "?")),
                   seq=None if d.get("seq") is None else int(d["seq"]),
                   kind=MismatchKind(d.get("kind", MismatchKind.MISSING)),
                   pg_desc=str(d.get("pg_desc", "")),
                   members=[int(r) for r in d.get("ranks") or []],
                   per_rank={int(r): RankCollective.from_dict(c)
                             for r, c in (d.get("per_rank") or {}).items()},
                   phase=d.get("phase"))


@dataclass
class TimelineCell:
    op: str
    sizes: list[list[int]]
    state: str  # done | pending | posted | unknown (posted, not in its evidence)
    name: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"op": self.op, "sizes": self.sizes, "state": self.state, "name": self.name}

    @classmethod
    def from_dict(cls, d: Any) -> TimelineCell | None:
        if not isinstance(d, dict):
            return None
        return cls(str(d.get("op", "?")), [list(x) for x in d.get("sizes") or []],
                   str(d.get("state", "")), d.get("name"))


@dataclass
class Timeline:
    """One group's collectives around the divergence: ranks × sequence numbers."""

    pg: str
    pg_desc: str
    seqs: list[int]
    highlight: int | None
    ranks: dict[int, list[TimelineCell | None]]

    def to_dict(self) -> dict[str, Any]:
        return {"pg": self.pg, "pg_desc": self.pg_desc, "seqs": self.seqs,
                "highlight": self.highlight,
                "ranks": {str(r): [c.to_dict() if c else None for c in cells]
                          for r, cells in self.ranks.items()}}

    @classmethod
    def from_dict(cls, d: Any) -> Timeline | None:
        if not isinstance(d, dict):
            return None
        return cls(pg=str(d.get("pg", "")), pg_desc=str(d.get("pg_desc", "")),
                   seqs=[int(x) for x in d.get("seqs") or []], highlight=d.get("highlight"),
                   ranks={int(r): [TimelineCell.from_dict(c) for c in cells]
                          for r, cells in (d.get("ranks") or {}).items()})




@dataclass
class Diagnosis:
    verdict: Verdict
    summary: str
    culprit_ranks: list[int] = field(default_factory=list)
    first_divergence: Divergence | None = None
    ranks: list[RankReport] = field(default_factory=list)
    fix: str = ""
    artifacts: str = ""
    evidence: list[str] = field(default_factory=list)
    timeline: Timeline | None = None
    run: RunInfo | None = None  # what the command that made it adds
    culprit_basis: CulpritBasis = CulpritBasis.NONE
    certainty: Certainty = Certainty.UNCERTAIN
    fix_code: str | None = None  # the fix as code to paste at the user's line, when one applies
    fix_site: Frame | None = None  # the line the fix is about, where it is not the culprit's
    fix_site_why: str | None = None  # what that line is to the culprit
    rule: str = ""  # the name of the rule that decided (docs/DESIGN.md §8)
    rule_id: str = ""  # its stable id (analysis.rules.RULES): what scripts key on
    divergences: list[Divergence] = field(default_factory=list)  # every diverging group
    # NCCL RAS as the diagnosis read it (analysis/ras/reading.py ras_summary); None: no report
    nccl_ras: dict[str, Any] | None = None
    # the MoE routers' token counts at the step the job stopped in (analysis/routing.py)
    routing: RoutingReport | None = None

    def rank(self, r: int) -> RankReport | None:
        # the report asks once per rank and clause: on 8192 ranks a scan each time was
        # seconds of the first screen. The index follows the list (rebuilt if it changed).
        index = self.__dict__.get("_rank_index")
        if index is None or index[0] is not self.ranks or index[1] != len(self.ranks):
            by_rank: dict[int, RankReport] = {}
            for x in self.ranks:
                by_rank.setdefault(x.rank, x)  # the first of a number, as a scan finds it
            index = (self.ranks, len(self.ranks), by_rank)
            self.__dict__["_rank_index"] = index
        return index[2].get(r)

    def routing_sentence(self) -> str | None:
        """The data decision beside a problem, in one sentence (the first screen's, check's):
        token counts where the divergence is one of sizes, else the culprit's starved
        expert; None beside a healthy job or where no router was counted."""
        if self.routing is None or self.verdict in (Verdict.HEALTHY, Verdict.STRAGGLER):
            return None
        size = self.first_divergence is not None and \
            self.first_divergence.kind == MismatchKind.SIZE
        return routing_sentence(self.routing, self.culprit_ranks, size)

    @property
    def timings(self) -> Timings | None:
        return self.run.timings if self.run is not None else None

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
            "culprit_basis": self.culprit_basis,
            "certainty": self.certainty,
            "rule": self.rule,
            "rule_id": self.rule_id,
        }
        if self.fix_code:
            d["fix_code"] = self.fix_code
        if self.fix_site is not None:
            d["fix_site"] = self.fix_site.as_dict()
        if self.fix_site_why:
            d["fix_site_why"] = self.fix_site_why
        if len(self.divergences) > 1:
            d["divergences"] = [x.to_dict() for x in self.divergences]
        if self.timeline is not None:
            d["timeline"] = self.timeline.to_dict()
        if self.nccl_ras is not None:
            d["nccl_ras"] = self.nccl_ras
        if self.routing is not None:
            d["routing"] = self.routing.to_dict()
        if self.run is not None:
            d.update(self.run.to_dict())
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Diagnosis:
        """:meth:`to_dict` read back, for the nodes that print the verdict another node
        analysed: every node renders the very same object. The command's own record
        (``run``) is not read back; every node adds its own."""
        return cls(
            verdict=Verdict(d.get("verdict", Verdict.INCONCLUSIVE)),
            summary=str(d.get("summary", "")),
            culprit_ranks=[int(r) for r in d.get("culprit_ranks") or []],
            first_divergence=Divergence.from_dict(d.get("first_divergence")),
            ranks=[RankReport.from_dict(r) for r in d.get("ranks") or []
                   if isinstance(r, dict)],
            fix=str(d.get("fix", "")), artifacts=str(d.get("artifacts", "")),
            evidence=[str(e) for e in d.get("evidence") or []],
            timeline=Timeline.from_dict(d.get("timeline")),
            culprit_basis=CulpritBasis(d.get("culprit_basis", CulpritBasis.NONE)),
            certainty=Certainty(d.get("certainty", Certainty.UNCERTAIN)),
            fix_code=d.get("fix_code"), fix_site=Frame.from_dict(d.get("fix_site")),
            fix_site_why=str(d["fix_site_why"]) if d.get("fix_site_why") else None,
            rule=str(d.get("rule", "")),
            rule_id=str(d.get("rule_id", "")),
            divergences=[x for x in (Divergence.from_dict(v) for v in d.get("divergences") or [])
                         if x is not None],
            nccl_ras=d["nccl_ras"] if isinstance(d.get("nccl_ras"), dict) else None,
            routing=RoutingReport.from_dict(d.get("routing")))
