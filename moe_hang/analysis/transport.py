"""The transport or hardware hang (pure): every rank in the same collective, posted alike,
and it completes nowhere — NCCL only. Never the collective order, never a code bug.

Three pieces of evidence, each alone uncertain, together likely (docs/DESIGN.md §13):
the recorder with start events (TORCH_NCCL_ENABLE_TIMING=1) shows every rank's kernel
*started* it and none completed; RAS shows every rank RUNNING at equal launch counts, frozen
across two polls; and, without timing, only that every rank posted it. Timing also names the
ranks to look at first: a kernel that never started (that GPU never got there: earlier work
holds its stream) or one that started seconds after the others' (by the ranks' clocks).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from moe_hang.analysis.advice import Advice
from moe_hang.analysis.conclusion import Conclusion
from moe_hang.analysis.diagnosis import Certainty, CulpritBasis, Verdict, pg_label
from moe_hang.analysis.facts import Facts
from moe_hang.analysis.ras.common import cap, ras_of
from moe_hang.analysis.ras.counts import LAUNCH_COUNTS_CAVEAT
from moe_hang.analysis.ras.findings import FindingKind
from moe_hang.analysis.ras.reading import RasReading
from moe_hang.evidence.flight_recorder import Collective
from moe_hang.evidence.vocab import RankState, spans

TIMING_HINT = "TORCH_NCCL_ENABLE_TIMING=1"
LATE_START_S = 1.0  # a kernel that started this much after the others' is named


@dataclass
class Transport:
    coll: Collective | None  # the collective every rank is in (None: RAS alone)
    ranks: list[int]  # the ranks in it
    frozen: bool  # RAS: two polls, every communicator frozen at equal counts
    timing: bool  # the recorder has start events
    started: list[int] = field(default_factory=list)  # ranks whose kernel started it
    never_started: list[int] = field(default_factory=list)  # timing: ranks whose did not
    late: list[int] = field(default_factory=list)  # timing: started last, well after
    late_by_s: float = 0.0
    spread_s: float | None = None  # between the first and last start
    stacks_only: bool = False  # the collective from the stacks (no recorder)

    @property
    def certainty(self) -> Certainty:
        started_everywhere = self.timing and bool(self.started) and not self.never_started
        return (Certainty.LIKELY if self.frozen and (started_everywhere or self.never_started)
                else Certainty.UNCERTAIN)


def _nccl(f: Facts) -> bool:
    for v in f.views.values():
        fr = v.ev.fr
        if fr is not None and fr.backend:
            if fr.backend == "nccl":
                return True
            continue
        hb = v.ev.heartbeat
        if hb is not None and (hb.backend == "nccl" or any(
                str(e.get("profiling_name", "")).startswith("nccl:") for e in hb.pending)):
            return True
    return ras_of(f) is not None


def _gloo(f: Facts) -> bool:
    return any(((fr := v.ev.fr) is not None and fr.backend == "gloo")
               or (v.ev.heartbeat is not None and v.ev.heartbeat.backend == "gloo")
               for v in f.views.values())


def _same(c: Collective) -> tuple[str, int, str]:
    return (c.pg_desc if c.pg_desc and c.pg_desc != "undefined" else c.pg, c.seq, c.op)


def _frozen_equal(ras: RasReading | None) -> bool:
    if ras is None or not ras.compared:
        return False
    cmp = ras.comparison
    return (cmp.all_frozen and bool(cmp.of(FindingKind.FROZEN_EQUAL))
            and not cmp.of(FindingKind.FROZEN_MISMATCH, FindingKind.MOVING,
                           FindingKind.LAGGING))


def transport(f: Facts) -> Transport | None:
    """Every live rank waits in the same collective, posted alike, and it completes nowhere
    (NCCL); or, with RAS alone, every communicator frozen at equal counts."""
    if _gloo(f) or not _nccl(f):
        return None
    ras = ras_of(f)
    frozen = _frozen_equal(ras)
    if not f.views:
        return Transport(None, [], frozen, False) if frozen else None
    if not f.alive or f.moving or len(f.waiting) != len(f.alive):
        return None
    views = [f.views[r] for r in f.alive]
    currents = [v.current for v in views]
    if all(c is not None for c in currents):
        colls = [c for c in currents if c is not None]
        if len({_same(c) for c in colls}) != 1:
            return None
        timing = (any(v.ev.fr is not None and v.ev.fr.timing for v in views)
                  or any(c.state == "started" for c in colls)
                  or any(st.started >= 0 for v in views if v.ev.heartbeat is not None
                         for st in (v.ev.heartbeat.pg_status or {}).values()))
        t = Transport(colls[0], list(f.alive), frozen, timing)
        if timing:
            t.started = [r for r, c in zip(f.alive, colls, strict=True) if c.started]
            t.never_started = [r for r in f.alive if r not in t.started]
            _late(t, {r: c.time_started_ns for r, c in zip(f.alive, colls, strict=True)})
        return t
    if frozen and all(v.state == RankState.IN_COLLECTIVE and v.stack.op for v in views) \
            and len({v.stack.op for v in views}) == 1:
        return Transport(None, list(f.alive), frozen, False, stacks_only=True)
    return None


def _late(t: Transport, starts: dict[int, int | None]) -> None:
    known = {r: s for r, s in starts.items() if s is not None}
    if len(known) < 2:
        return
    first, last = min(known.values()), max(known.values())
    t.spread_s = (last - first) / 1e9
    others = sorted(known.values())
    # the latest starters, when they started well after every other rank
    late = [r for r, s in known.items() if s == last]
    rest = [s for s in others if s != last]
    if rest and (last - max(rest)) / 1e9 >= LATE_START_S and len(late) < len(known) / 2:
        t.late, t.late_by_s = sorted(late), (last - max(rest)) / 1e9


def _span(seconds: float) -> str:
    if seconds < 0.001:
        return "a millisecond"
    return f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.1f} s"


def _hosts(f: Facts, ranks: list[int]) -> str:
    """The hosts of these ranks as the tool knows them, else RAS's (addresses)."""
    hosts = sorted({h for r in ranks if r in f.views and (h := f.views[r].ev.host)})
    ras = ras_of(f)
    if not hosts and ras is not None and ras.latest is not None:
        procs = {(r.host, g) for c in ras.latest.communicators for r in c.ranks
                 if r.pid >= 0 and r.host != "unknown"
                 and ((g := ras.global_rank(c.key, r.rank)) in ranks or not ranks)}
        hosts = sorted({h for h, _ in procs})
    return ", ".join(hosts[:3]) + (", …" if len(hosts) > 3 else "")


def transport_hang(f: Facts) -> Conclusion:
    t = transport(f)
    ras = ras_of(f)
    assert t is not None
    when = (f"in {ras.interval_s:.1f} s" if ras is not None and ras.interval_s is not None
            else "between the polls")
    frozen = (f"RAS shows every rank RUNNING at equal launch counts and no launch {when} "
              f"({LAUNCH_COUNTS_CAVEAT})")
    culprits: list[int] = []
    basis = CulpritBasis.NONE
    if t.coll is None and not t.stacks_only:
        summary = (f"{frozen}: every rank waits in the same collective — a transport or "
                   "hardware hang — or the job is outside NCCL (a CPU loop, I/O). The ranks' "
                   f"stacks (`moe-hang diagnose`) and the recorder with {TIMING_HINT} would "
                   "tell.")
    elif t.coll is None:
        op = f.views[t.ranks[0]].stack.op
        summary = (f"Every rank waits in {op} (their stacks), and {frozen}: a transport or "
                   f"hardware hang, not the collective order. The recorder with {TIMING_HINT}"
                   " would tell whether every kernel started.")
    else:
        c = t.coll
        name = f"{c.op} {pg_label(c.pg, c.pg_desc)}#{c.seq}"
        head = (f"All {len(t.ranks)} ranks posted {name} alike (same order and sizes) and "
                "none completed it")
        if t.timing and t.never_started and t.started:
            culprits, basis = t.never_started, CulpritBasis.KERNEL_TIMING
            head += (f"; rank {spans(t.started)}'s kernel started it, rank "
                     f"{spans(t.never_started)}'s never did: that GPU never got to it (earlier "
                     "work holds its stream)")
        elif t.timing and t.never_started:
            head += "; no rank's kernel started it: earlier work holds every GPU's stream"
        elif t.timing:
            head += "; every rank's kernel started it"
            if t.late:
                culprits, basis = t.late, CulpritBasis.KERNEL_TIMING
                head += (f", rank {spans(t.late)}'s {t.late_by_s:.1f} s after the others' "
                         "(look there first)")
            elif t.spread_s is not None:
                head += f" within {_span(t.spread_s)} (timing singles out no rank)"
        summary = head + ": a transport or hardware hang, not a desync."
        if t.frozen:
            summary += f" {cap(frozen)}."
        elif ras is None:
            summary += (" Two RAS reports a few seconds apart (`--ras`, or live on an NCCL "
                        "job) would show whether launches froze.")
        if not t.timing:
            summary += (f" Whether every kernel started, {TIMING_HINT} would tell (all "
                        "started: the transport or a GPU; one never did: that rank's GPU).")
    hosts = _hosts(f, culprits or t.ranks)
    on = (f" on {hosts}" if hosts else " on those ranks' hosts" if culprits
          else " on the job's hosts")
    text = (f"Run `nvidia-smi -q`{on} (a GPU error or Xid; a GPU busy with nothing moving), "
            "rerun with NCCL_DEBUG=INFO to see the transport (rings, channels, a failing NIC "
            "or NVLink), and replace the node "
            + (("that rank runs on" if len(culprits) == 1 else "those ranks run on")
               if culprits else "with the faulty GPU or link")
            + " if it recurs.")
    return Conclusion(Verdict.TRANSPORT_HANG, culprits, basis, t.certainty, summary,
                      Advice(text))
