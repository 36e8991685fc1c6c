"""A count shift on a group (docs/DESIGN.md §8): where the wait-for cycle runs through a line
of a loop's body that posts a collective on group G whatever the rank (no ``if``, no early
leave, no rank condition before it in the body), the ranks waiting in it as G#s and the ranks
past it in the same pass — having posted it themselves, as an earlier number — skipped
nothing there. One side posted more collectives on G before this pass's line than the other:
an extra (gloo paired it silently with the other side's next one of equal size) or a skip.
Which side: the smaller one (the ranks whose counts the evidence holds; the rest are not
counted); as many on each side, or the passed ranks at different counts, decides nothing.
Pure."""

from __future__ import annotations

from dataclasses import dataclass

from moe_hang.analysis.diagnosis import Verdict, pg_label
from moe_hang.analysis.explain import site_str
from moe_hang.analysis.gates import passed_through
from moe_hang.analysis.readings import at
from moe_hang.analysis.situation import Advice
from moe_hang.analysis.timeline import RankViews
from moe_hang.analysis.waitfor import Edge
from moe_hang.evidence.stacks import Frame
from moe_hang.evidence.vocab import agree, who


@dataclass(frozen=True)
class Shift:
    edge: Edge  # the cycle's edge whose waited collective the others passed
    op: str
    pg: str
    pg_desc: str
    seq: int  # what the ahead side waits in
    passed_seq: int  # what the passed side posted that line's collective as
    ahead: tuple[int, ...]  # waiting in it
    passed: tuple[int, ...]  # past its line in the same pass
    site: Frame  # the line

    @property
    def extra(self) -> bool:
        """The ahead side is the smaller: it posted more (an extra); else the passed side
        posted fewer (a skip)."""
        return len(self.ahead) < len(self.passed)

    @property
    def culprits(self) -> list[int]:
        return sorted(self.ahead if self.extra else self.passed)

    @property
    def others(self) -> list[int]:
        return sorted(self.passed if self.extra else self.ahead)


def count_shift(cycle: list[Edge], views: RankViews) -> Shift | None:
    for e in cycle:
        w = e.coll
        if w is None or w.seq is None:
            continue
        fb = list(at(w, views[e.waiter]))
        ahead = sorted(r for r, v in views.items() if v.current is not None
                       and (v.current.pg, v.current.seq) == (w.pg, w.seq))
        passed: list[int] = []
        counts: set[int] = set()
        for r, v in views.items():
            posted = v.tl.enqueued.get(w.pg, -1)
            if r in ahead or w.pg not in v.tl.by_pg or not 0 <= posted < w.seq:
                continue
            if fb and passed_through(views.source, list(v.position), fb):
                passed.append(r)
                counts.add(posted)
        if passed and len(counts) == 1 and len(ahead) != len(passed):
            return Shift(e, w.op, w.pg, w.pg_desc, w.seq, counts.pop(), tuple(ahead),
                         tuple(passed), fb[-1])
    return None


def shifted(sh: Shift) -> tuple[Verdict, str, Advice]:
    """The sentence and the advice. How many more: not said — a collective on G between the
    line and where the passed ranks are counts in their number too."""
    group = pg_label(sh.pg, sh.pg_desc)
    c, o = sh.culprits, sh.others
    line = site_str(sh.site)
    said = (f" {who(sh.passed).capitalize()} went through {line} in this pass, having posted "
            f"up to {group}#{sh.passed_seq}; {who(sh.ahead)} "
            f"{agree(sh.ahead, 'waits', 'wait')} in its {sh.op} as #{sh.seq}: ")
    if sh.extra:
        said += (f"{who(c)} posted more collectives on {group} before it than "
                 f"{who(o)} (an extra, paired silently with their next of the same size).")
        text = (f"{who(c).capitalize()} posted more collectives on {group} than {who(o)} "
                f"before {line}: one that runs on {agree(c, 'it', 'them')} only (a log, a "
                "metric, a check under a condition on the rank). Post it on every rank of "
                "the group, or on a group of its own.")
    else:
        said += f"{who(c)} posted fewer on {group} before it than {who(o)} (a skip)."
        text = (f"{who(c).capitalize()} posted fewer collectives on {group} than {who(o)} "
                f"before {line}: one the others post, skipped there (an `if` or `continue` "
                "on the rank's own data). Post every collective of a pass on every rank.")
    return Verdict.DESYNC, said, Advice(text)
