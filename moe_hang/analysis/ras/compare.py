"""Two RAS reports taken a few seconds apart -> what moved, what froze, who is behind —
pure.

Per communicator and rank: counts that grew are *moving*; counts that stayed are *frozen*. In a
communicator where nothing moved, ranks whose count of an op is below the highest never
launched the collective the others launched (it cannot complete without them): a *frozen
mismatch*. Every rank frozen at the same counts is the symmetric case RAS cannot resolve (a
hang inside one collective everyone launched — a transport or hardware fault — or a job
outside NCCL): *frozen equal*. Counts that went down are not compared (a communicator re-made
under the same hash; SGLang reports all-zero samples from busy jobs). States come from the
second, latest report. Every sentence built from counts carries the launch caveat
(:mod:`moe_hang.analysis.ras.counts`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from moe_hang.analysis.ras.counts import launched, ordinal, with_launch_caveat
from moe_hang.analysis.ras.findings import (
    FindingKind,
    Namer,
    RasCommProgress,
    RasComparison,
    RasFinding,
)
from moe_hang.analysis.ras.states import state_findings
from moe_hang.evidence.ras.ranks import ProcessKey, global_rank_maps
from moe_hang.evidence.ras.records import (
    COUNTED_OPS,
    RasCommunicator,
    RasCountGroup,
    RasReport,
)
from moe_hang.evidence.vocab import who

_TIMESTAMP = "%Y-%m-%d %H:%M:%S"  # the writer's strftime("%F %T"), local time


def _ops(counts: list[dict[str, int]]) -> list[str]:
    seen = {op for c in counts for op in c}
    return [op for op in COUNTED_OPS if op in seen] + sorted(seen - set(COUNTED_OPS))


def _interval_text(interval_s: float | None) -> str:
    return f"in {interval_s:.1f} s" if interval_s is not None else "between the two polls"


def _timestamp_gap(a: RasReport, b: RasReport) -> float | None:
    try:
        ta = time.mktime(time.strptime(a.timestamp, _TIMESTAMP))
        tb = time.mktime(time.strptime(b.timestamp, _TIMESTAMP))
    except (ValueError, OverflowError):
        return None
    return tb - ta if tb >= ta else None


def _levels(vals: Mapping[int, int], op: str) -> str:
    """``rank 1 launched AllReduce 100 times, ranks 0, 2-3 101 times``."""
    by: dict[int, list[int]] = {}
    for r, v in vals.items():
        by.setdefault(v, []).append(r)
    parts = []
    for i, v in enumerate(sorted(by)):
        what = launched(op, v) if i == 0 else (f"{v} times" if v else "none")
        parts.append(f"{who(by[v])} {what}")
    return ", ".join(parts)


class _Counts:
    """The count findings of one communicator present in both reports."""

    def __init__(self, namer: Namer, interval_s: float | None) -> None:
        self.n = namer
        self.when = _interval_text(interval_s)

    def per_rank(self, a: RasCommunicator, b: RasCommunicator
                 ) -> tuple[list[RasFinding], RasCommProgress]:
        prev = {r.rank: r.collective_counts for r in a.ranks if r.collective_counts}
        now = {r.rank: r.collective_counts for r in b.ranks if r.collective_counts}
        common = sorted(set(prev) & set(now))
        ops = _ops([prev[r] for r in common] + [now[r] for r in common])
        reset = [r for r in common
                 if any(now[r].get(op, 0) < prev[r].get(op, 0) for op in ops)]
        compared = tuple(r for r in common if r not in reset)
        out: list[RasFinding] = []
        name = self.n.comm(b)
        if reset:
            t = tuple(reset)
            out.append(self.n.finding(FindingKind.COUNT_RESET, b, t, with_launch_caveat(
                f"The counts of {self.n.who(b, t)} of {name} went down between the two polls: "
                "a communicator re-created under the same hash, or a sample without counts; "
                "they are not compared")))
        if not compared:
            return out, RasCommProgress(b.key, b.hash, b.size, "unknown", ())
        moved = tuple(r for r in compared if any(now[r].get(op, 0) > prev[r].get(op, 0)
                                                 for op in ops))
        if moved:
            out += self._moving(b, moved, compared, prev, now, ops)
            return out, RasCommProgress(b.key, b.hash, b.size, "moving", compared, moved)
        out += self._frozen(b, {r: now[r] for r in compared}, ops)
        return out, RasCommProgress(b.key, b.hash, b.size, "frozen", compared)

    def _moving(self, c: RasCommunicator, moved: tuple[int, ...], compared: tuple[int, ...],
                prev: Mapping[int, Mapping[str, int]], now: Mapping[int, Mapping[str, int]],
                ops: list[str]) -> list[RasFinding]:
        deltas = []
        for op in ops:
            d = max(now[r].get(op, 0) - prev[r].get(op, 0) for r in moved)
            if d > 0:
                deltas.append(f"{op} +{d}")
        name = self.n.comm(c)
        out = [self.n.finding(FindingKind.MOVING, c, moved, with_launch_caveat(
            f"In {name} {self.n.who(c, moved)} launched more collectives {self.when} "
            f"({', '.join(deltas)}): the communicator is moving"))]
        stayed = [r for r in compared if r not in moved]
        for op in ops:
            top = max(now[r].get(op, 0) for r in compared)
            behind = tuple(r for r in stayed if now[r].get(op, 0) < top)
            if not behind:
                continue
            low = min(now[r].get(op, 0) for r in behind)
            ahead = tuple(r for r in compared if now[r].get(op, 0) == top)
            out.append(self.n.finding(FindingKind.LAGGING, c, behind, with_launch_caveat(
                f"In {name} {self.n.who(c, behind)} launched nothing {self.when} while "
                f"{self.n.who(c, moved)} launched more, and "
                f"{'it is' if len(behind) == 1 else 'they are'} behind: "
                f"{_levels({r: now[r].get(op, 0) for r in compared}, op)}"),
                op=op, count=low, ahead=top, ahead_ranks=ahead))
        return out

    def _frozen(self, c: RasCommunicator, now: Mapping[int, Mapping[str, int]],
                ops: list[str]) -> list[RasFinding]:
        out = []
        name = self.n.comm(c)
        for op in ops:
            vals = {r: counts.get(op, 0) for r, counts in now.items()}
            top = max(vals.values())
            behind = tuple(r for r, v in vals.items() if v < top)
            if not behind:
                continue
            ahead = tuple(r for r, v in vals.items() if v == top)
            out.append(self.n.finding(FindingKind.FROZEN_MISMATCH, c, behind, with_launch_caveat(
                f"In {name} no rank launched a collective {self.when}, and {_levels(vals, op)}: "
                f"{self.n.who(c, behind)} never launched the {ordinal(top)} {op} that "
                f"{self.n.who(c, ahead)} launched, which cannot complete without "
                f"{'it' if len(behind) == 1 else 'them'}"),
                op=op, count=min(vals[r] for r in behind), ahead=top, ahead_ranks=ahead))
        if out:
            return out
        ranks = tuple(now)
        sample = next(iter(now.values()))
        what = ", ".join(f"{op} {sample[op]}" for op in ops if sample.get(op))
        same = f"the same collectives ({what})" if what else "no collective yet"
        of = f" of {c.size}" if c.size > len(ranks) else ""
        out.append(self.n.finding(FindingKind.FROZEN_EQUAL, c, ranks, with_launch_caveat(
            f"In {name} the {len(ranks)}{of} ranks RAS reached launched {same} and none "
            f"launched another {self.when}: their counts cannot say whom "
            "anyone waits for — every rank waits in the same collective (a transport or "
            "hardware fault), or the job is outside NCCL")))
        return out

    def grouped(self, a: RasCommunicator, b: RasCommunicator
                ) -> tuple[list[RasFinding], RasCommProgress]:
        """Either side a text report: only its count groups (printed when counts disagree)."""
        ga, gb = _groups(a), _groups(b)
        if not ga and not gb:
            return [], RasCommProgress(b.key, b.hash, b.size, "unknown", ())
        if _group_key(ga) != _group_key(gb):
            return [self.n.finding(FindingKind.MOVING, b, (), with_launch_caveat(
                f"In {self.n.comm(b)} the launch counts changed {self.when}"))], \
                RasCommProgress(b.key, b.hash, b.size, "moving", ())
        out = []
        for op in dict.fromkeys(g.op for g in gb):
            groups = [g for g in gb if g.op == op]
            top = max(g.count for g in groups)
            behind = [g for g in groups if g.count < top]
            named = tuple(r for g in behind for r in g.ranks)
            n_behind = sum(g.n_ranks for g in behind)
            ahead = [g for g in groups if g.count == top]
            subject = (self.n.who(b, named) if len(named) == n_behind
                       else f"{n_behind} ranks (the text report names "
                       f"{'only ' + self.n.who(b, named) if named else 'none of them'})")
            levels = ", ".join(f"{g.n_ranks} launched up to {g.count}" for g in groups)
            out.append(self.n.finding(FindingKind.FROZEN_MISMATCH, b, named, with_launch_caveat(
                f"In {self.n.comm(b)} the {op} counts stayed {self.when} ({levels}): {subject} "
                f"never launched the {ordinal(top)} {op} the other "
                f"{sum(g.n_ranks for g in ahead)} launched"),
                op=op, count=min(g.count for g in behind), ahead=top,
                ahead_ranks=tuple(r for g in ahead for r in g.ranks), n_ranks=n_behind))
        return out, RasCommProgress(b.key, b.hash, b.size, "frozen", ())


def _groups(c: RasCommunicator) -> tuple[RasCountGroup, ...]:
    """The text report's count groups; for a JSON communicator the same, built from every
    rank, where its counts disagree (as the text report would print them)."""
    if not c.complete:
        return c.count_groups
    out: list[RasCountGroup] = []
    live = [r for r in c.ranks if r.collective_counts]
    for op in _ops([r.collective_counts for r in live]):
        by: dict[int, list[int]] = {}
        for r in live:
            by.setdefault(r.collective_counts.get(op, 0), []).append(r.rank)
        if len(by) > 1:
            out += [RasCountGroup(op, v, len(rs), tuple(rs)) for v, rs in sorted(by.items())]
    return tuple(out)


def _group_key(gs: tuple[RasCountGroup, ...]) -> set[tuple[str, int, int]]:
    return {(g.op, g.count, g.n_ranks) for g in gs}


def _maps(reports: tuple[RasReport, ...], processes: Mapping[ProcessKey, int] | None,
          aliases: Mapping[str, str] | None,
          maps: Mapping[str, Mapping[int, int]] | None) -> Mapping[str, Mapping[int, int]]:
    if maps is not None:
        return maps
    out: dict[str, dict[int, int]] = {}
    for rep in reversed(reports):
        if processes:
            for key, m in global_rank_maps(rep, processes, aliases=aliases).items():
                out.setdefault(key, m)
    return out


def compare_reports(first: RasReport, second: RasReport, *, interval_s: float | None = None,
                    processes: Mapping[ProcessKey, int] | None = None,
                    aliases: Mapping[str, str] | None = None,
                    maps: Mapping[str, Mapping[int, int]] | None = None) -> RasComparison:
    """What changed from ``first`` to ``second`` (taken ``interval_s`` later; else the
    reports' timestamps say, to the second). ``processes``: (host, pid) -> global rank, to name
    global ranks in the findings (:mod:`moe_hang.evidence.ras.ranks`); or ``maps``, per
    communicator key its rank -> global rank, already worked out
    (:func:`moe_hang.evidence.ras.mapping.infer_global_ranks`)."""
    if interval_s is None:
        interval_s = _timestamp_gap(first, second)
    namer = Namer(_maps((first, second), processes, aliases, maps))
    counts = _Counts(namer, interval_s)
    findings: list[RasFinding] = []
    progress: list[RasCommProgress] = []
    both_json = first.fmt == second.fmt == "json"
    before = {c.key: c for c in first.communicators}
    for c in second.communicators:
        findings += state_findings(c, namer)
        a = before.pop(c.key, None) or (None if both_json else first.communicator(c.hash))
        if a is None:
            if both_json:
                findings.append(namer.finding(FindingKind.APPEARED, c, (), (
                    f"{namer.comm(c)} is only in the second report: created between the "
                    "polls, or its ranks did not answer the first.")))
            progress.append(RasCommProgress(c.key, c.hash, c.size, "unknown", ()))
            continue
        got, p = counts.per_rank(a, c) if both_json else counts.grouped(a, c)
        findings += got
        progress.append(p)
    if both_json:
        for c in before.values():
            findings.append(namer.finding(FindingKind.VANISHED, c, (), (
                f"{namer.comm(c)} is only in the first report: destroyed between the polls, "
                "or its ranks did not answer the second.")))
    return RasComparison(interval_s, tuple(findings), tuple(progress))


def one_report(report: RasReport, *, processes: Mapping[ProcessKey, int] | None = None,
               aliases: Mapping[str, str] | None = None,
               maps: Mapping[str, Mapping[int, int]] | None = None) -> RasComparison:
    """What a single report says: its ranks' states, and where counts disagree — which one
    report cannot call frozen or moving (a rank one launch behind may be on its way: only a
    second report a few seconds later tells)."""
    namer = Namer(_maps((report,), processes, aliases, maps))
    findings: list[RasFinding] = []
    progress: list[RasCommProgress] = []
    for c in report.communicators:
        findings += state_findings(c, namer)
        name = namer.comm(c)
        groups = _groups(c)
        for op in dict.fromkeys(g.op for g in groups):
            mine = sorted((g for g in groups if g.op == op), key=lambda g: g.count)
            top = mine[-1].count
            behind = tuple(r for g in mine if g.count < top for r in g.ranks)
            ahead = tuple(r for g in mine if g.count == top for r in g.ranks)
            n_behind = sum(g.n_ranks for g in mine if g.count < top)
            subject = (namer.who(c, behind) if len(behind) == n_behind
                       else f"{n_behind} ranks")
            levels = ", ".join(f"{g.n_ranks} at {g.count}" for g in mine)
            findings.append(namer.finding(FindingKind.COUNTS_DIFFER, c, behind, with_launch_caveat(
                f"In {name} the {op} counts differ in this one report ({levels}): {subject} "
                f"had not launched the {ordinal(top)} {op}; one report cannot tell a rank on "
                "its way from one that never launches it — a second report a few seconds "
                "later would"),
                op=op, count=mine[0].count, ahead=top, ahead_ranks=ahead, n_ranks=n_behind))
        progress.append(RasCommProgress(c.key, c.hash, c.size, "unknown", ()))
    return RasComparison(None, tuple(findings), tuple(progress))

