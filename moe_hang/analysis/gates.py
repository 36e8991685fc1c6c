"""The data decision behind a skip (docs/DESIGN.md §8, advice): a culprit that posted its
last agreed collective from a line of the function the others' next collective is in, and
never posted that one, went past it through one of the *gates* the source shows between
the two lines — an ``if`` the collective sits in, or a guard that leaves early (``if
remote == 0: return``). Where the source shows exactly one, that is the branch the
culprit's data took and the others' did not. Pure."""

from __future__ import annotations

from moe_hang.analysis.situation import Advice, Situation, at_line
from moe_hang.analysis.source import gates, rank_condition
from moe_hang.evidence.source import Gate
from moe_hang.evidence.stacks import Frame, short_path
from moe_hang.evidence.vocab import who


def gates_passed(s: Situation, culprit: int, missed: Frame | None, now: Frame | None
                 ) -> list[Gate]:
    """The gates between the culprit's last agreed collective and ``missed`` (the line the
    others posted next, in the same function): the ways the source shows past ``missed``.
    Empty where the culprit's last line is elsewhere, or where its line now lies between
    the two (it may have posted an extra there, not skipped anything)."""
    prev = s.before.get(culprit)
    if prev is None or missed is None or (prev.file, prev.function) != \
            (missed.file, missed.function) or prev.line >= missed.line:
        return []
    if now is not None and (now.file, now.function) == (missed.file, missed.function) \
            and prev.line < now.line < missed.line:
        return []
    if rank_condition(s.src, missed.file, missed.line) is not None:
        return []  # a branch on the rank: the advice on rank conditions says it
    return [g for g in gates(s.src, missed.file, missed.line) if g.line > prev.line]


def _code(g: Gate) -> str:
    """Gate ``g`` as the source spells it."""
    if g.how == "if":
        return f"`if {g.test}:` around it"
    if g.how == "else":
        return f"the `else` of `if {g.test}:` around it"
    return f"`if {g.test}: {g.how}`"


def advise_gate(s: Situation, culprit: int, missed: Frame, found: list[Gate]) -> Advice:
    """The branch that let ``culprit`` past the collective the others posted at ``missed``."""
    prev = s.before[culprit]
    op = next((c.op for r, c in s.div.per_rank.items() if r in s.waiting() and c), "")
    head = (f"{who([culprit]).capitalize()} skipped the {op or 'collective'} at "
            f"{at_line(missed)}: from its last collective ({at_line(prev)}) ")
    name, others = short_path(missed.file), who(s.waiting())
    if len(found) == 1:
        g = found[0]
        # an `if` around it is passed by its test, not taken
        took = {"if": f"its test was false on it, true on {others}",
                "else": f"its test was true on it, false on {others}"}.get(
            g.how, f"it took that branch, {others} did not")
        return Advice(
            f"{head}the one way past it the source shows is {_code(g)} ({name}:{g.line}): "
            f"{took}. Post it on every rank whatever the data (an empty tensor if need be), "
            "or decide the branch alike on every rank.",
            site=Frame(missed.file, g.line, missed.function))
    ways = "; ".join(f"{_code(g)} ({name}:{g.line})" for g in found)
    return Advice(
        f"{head}the source shows {len(found)} ways past it ({ways}), and it took one that "
        f"{others} did not. Post it on every rank whatever the data, or decide those "
        "branches alike on every rank.")
