"""A verdict from summaries alone (:func:`basic_verdict`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from moe_hang.runtime.coord.summary import NodeSummary


def basic_verdict(summaries: Mapping[str, NodeSummary], missing: Sequence[str],
                  world: int | None = None) -> dict[str, Any]:
    """A small verdict from summaries alone (tests, the benchmark, and a last resort): ranks
    pending at the same (group, seq) with a different op/size/dtype (desync, the minority to
    blame); otherwise ranks of captured nodes that are not in the collective others wait in
    (hang). Ranks of missing nodes are unknown, never culprits."""
    ranks = {r.rank: (s, r) for s in summaries.values() for r in s.ranks}
    at: dict[tuple[str, int], dict[Any, list[int]]] = {}
    for rank, (_s, r) in ranks.items():
        if r.pending:
            p = r.pending[0]
            at.setdefault((p.pg_id, p.seq), {}).setdefault(p.signature(), []).append(rank)
    for (pg, seq), sigs in sorted(at.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        if len(sigs) > 1:
            groups = sorted(sigs.values(), key=lambda g: (len(g), g))
            culprits = sorted(r for g in groups[:-1] for r in g)
            per = {str(rs[0]): {"op": sig[0], "sizes": [list(x) for x in sig[1]],
                                "callsite": ranks[rs[0]][1].callsite, "host": ranks[rs[0]][0].host}
                   for sig, rs in sigs.items()}
            return {"verdict": "desync", "pg": pg, "seq": seq, "culprit_ranks": culprits,
                    "summary": f"ranks posted different collectives at seq {seq} of group {pg}: "
                               + "; ".join(f"rank {k} {v['op']}{v['sizes']} on {v['host']}"
                                           for k, v in per.items()),
                    "per_rank": per, "unknown_nodes": list(missing)}
    waiting = sorted(r for r, (_s, x) in ranks.items() if x.pending)
    if waiting:
        not_there = sorted(r for r, (_s, x) in ranks.items() if not x.pending)
        return {"verdict": "hang", "culprit_ranks": not_there, "waiting_ranks": waiting,
                "summary": (f"{len(waiting)} ranks wait in a collective; "
                            + (f"ranks {not_there} are elsewhere" if not_there
                               else "every captured rank is in it")
                            + (f"; nodes {list(missing)} unknown" if missing else "")),
                "unknown_nodes": list(missing)}
    return {"verdict": "inconclusive", "culprit_ranks": [], "unknown_nodes": list(missing),
            "summary": "no rank waits in a collective"}
