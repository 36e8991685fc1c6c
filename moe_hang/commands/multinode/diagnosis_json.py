"""A verdict as data: a diagnosis back from its JSON (:func:`diagnosis_from_dict`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from moe_hang.analysis.diagnosis import (
    Certainty,
    CulpritBasis,
    Diagnosis,
    Divergence,
    MismatchKind,
    RankCollective,
    RankReport,
    RankState,
    Timeline,
    TimelineCell,
    Verdict,
)
from moe_hang.evidence.stacks import Frame


def _frame(d: Any) -> Frame | None:
    if not isinstance(d, Mapping):
        return None
    try:
        return Frame(str(d["file"]), int(d.get("line") or 0), str(d.get("function", "?")))
    except (KeyError, TypeError, ValueError):
        return None


def _collective(d: Any) -> RankCollective | None:
    if not isinstance(d, Mapping):
        return None
    return RankCollective(
        op=str(d.get("op", "?")), pg=str(d.get("pg", "?")),
        seq=None if d.get("seq") is None else int(d["seq"]),
        input_sizes=[list(s) for s in d.get("input_sizes") or []],
        dtypes=[str(x) for x in d.get("dtypes") or []], source=str(d.get("source", "")),
        pg_desc=str(d.get("pg_desc", "")), tag=d.get("tag"), callsite=_frame(d.get("callsite")))


def _divergence(d: Any) -> Divergence | None:
    if not isinstance(d, Mapping):
        return None
    return Divergence(pg=str(d.get("pg", "?")),
                      seq=None if d.get("seq") is None else int(d["seq"]),
                      kind=MismatchKind(d.get("kind", MismatchKind.MISSING)),
                      pg_desc=str(d.get("pg_desc", "")),
                      members=[int(r) for r in d.get("ranks") or []],
                      per_rank={int(r): _collective(c)
                                for r, c in (d.get("per_rank") or {}).items()},
                      phase=d.get("phase"))


def _timeline(d: Any) -> Timeline | None:
    if not isinstance(d, Mapping):
        return None
    rows: dict[int, list[TimelineCell | None]] = {}
    for r, cells in (d.get("ranks") or {}).items():
        rows[int(r)] = [TimelineCell(str(c.get("op", "?")), [list(s) for s in c.get("sizes")
                                                              or []],
                                     str(c.get("state", "")), c.get("name"))
                        if isinstance(c, Mapping) else None for c in cells]
    return Timeline(pg=str(d.get("pg", "")), pg_desc=str(d.get("pg_desc", "")),
                    seqs=[int(s) for s in d.get("seqs") or []], highlight=d.get("highlight"),
                    ranks=rows)


def diagnosis_from_dict(d: Mapping[str, Any]) -> Diagnosis:
    """A diagnosis back from its JSON (``Diagnosis.to_dict``), for the nodes that print the
    verdict another node analysed: every node renders the very same object. The command's
    own record (``run``) is not read back; every node adds its own."""
    ranks = []
    for r in d.get("ranks") or []:
        ranks.append(RankReport(
            rank=int(r["rank"]), pid=r.get("pid"), host=r.get("host"),
            state=RankState(r.get("state", RankState.UNKNOWN)),
            collective=_collective(r.get("collective")), callsite=_frame(r.get("callsite")),
            tokens=r.get("tokens"), exit_code=r.get("exit_code"), phase=r.get("phase"),
            autograd_function=r.get("autograd_function"),
            stack=[str(s) for s in r.get("stack") or []], stack_source=r.get("stack_source"),
            note=r.get("note")))
    return Diagnosis(
        verdict=Verdict(d.get("verdict", Verdict.INCONCLUSIVE)), summary=str(d.get("summary", "")),
        culprit_ranks=[int(r) for r in d.get("culprit_ranks") or []],
        first_divergence=_divergence(d.get("first_divergence")), ranks=ranks,
        fix=str(d.get("fix", "")), artifacts=str(d.get("artifacts", "")),
        evidence=[str(e) for e in d.get("evidence") or []], timeline=_timeline(d.get("timeline")),
        culprit_basis=CulpritBasis(d.get("culprit_basis", CulpritBasis.NONE)),
        certainty=Certainty(d.get("certainty", Certainty.UNCERTAIN)),
        fix_code=d.get("fix_code"), rule=str(d.get("rule", "")),
        divergences=[x for x in (_divergence(v) for v in d.get("divergences") or [])
                     if x is not None])
