"""What the job's source says about two lines, asked of the facts the capture stored
(:class:`~moe_hang.evidence.source.SourceFacts`; pure: no file is opened here).

Line numbers alone mislead: in ``if rank == 0: a() else: b()`` the ``else`` branch has the
higher line, yet neither rank is "further along" — they took exclusive branches; and inside a
loop the statement with the lower line also runs *after* the higher one, in the next
iteration. So two lines are ordered only when, in the innermost block holding both, they sit
in different statements of that same block — and then only within one iteration of every
loop that holds both (:func:`common_loop` says whether one does). Lines in different branches
of one ``if``/``try``/``match`` are not ordered. Without facts for a file (torch's own dumps,
another machine's capture), nothing is ordered.
"""

from __future__ import annotations

import ast
import operator
import re
from collections.abc import Callable, Iterable
from enum import Enum
from typing import Any

from moe_hang.evidence.source import Gate, LineFacts, SourceFacts, Step
from moe_hang.evidence.stacks import Frame, is_library_frame

NO_FACTS = SourceFacts()


class Order(Enum):
    A_FIRST = "a"
    B_FIRST = "b"
    EXCLUSIVE = "exclusive"  # different branches of one statement: neither is "after"
    SAME = "same"
    UNKNOWN = "unknown"


_LOOPS = ("For", "While", "AsyncFor")
# In one statement, which of its blocks run one after the other (the rest are exclusive):
# a loop's or a try's ``else`` after its body, a ``finally`` after everything.
_SEQUENTIAL = {"body": 0, "orelse": 1, "finalbody": 2}


def _between_blocks(kind: str, fa: str, fb: str) -> Order:
    if kind in ("If", "Match") and "finalbody" not in (fa, fb):
        return Order.EXCLUSIVE
    if fa.startswith(("handlers", "cases")) or fb.startswith(("handlers", "cases")):
        if "finalbody" in (fa, fb):
            return Order.A_FIRST if fb == "finalbody" else Order.B_FIRST
        return Order.EXCLUSIVE
    ra, rb = _SEQUENTIAL.get(fa), _SEQUENTIAL.get(fb)
    if ra is None or rb is None or ra == rb:
        return Order.EXCLUSIVE
    return Order.A_FIRST if ra < rb else Order.B_FIRST


def _paths(src: SourceFacts, path: str, a: int, b: int
           ) -> tuple[tuple[Step, ...], tuple[Step, ...]] | None:
    la, lb = src.line(path, a), src.line(path, b)
    if la is None or lb is None:
        return None
    return la.path, lb.path


def order(src: SourceFacts, path: str, line_a: int, line_b: int) -> Order:
    """How two lines of the same file relate in statement order (see the module doc; a
    loop holding both does not make them exclusive: :func:`common_loop` says it is there)."""
    if line_a == line_b:
        return Order.SAME
    got = _paths(src, path, line_a, line_b)
    if got is None:
        return Order.UNKNOWN
    pa, pb = got
    parent: Step | None = None
    for sa, sb in zip(pa, pb, strict=False):
        if sa.block != sb.block:  # two blocks of the statement above: exclusive or in sequence
            return _between_blocks(parent.kind, sa.field, sb.field) if parent is not None \
                else Order.UNKNOWN
        if sa.index != sb.index:
            return Order.A_FIRST if sa.index < sb.index else Order.B_FIRST
        parent = sa
    # one line holds the other's statement (a compound statement's header vs its body):
    # the header runs first
    if len(pa) != len(pb):
        return Order.A_FIRST if len(pa) < len(pb) else Order.B_FIRST
    return Order.SAME


def common_loop(src: SourceFacts, path: str, line_a: int, line_b: int) -> int | None:
    """The line of the innermost loop whose body holds both lines (not one of them its
    header, nor its ``else``), else None: there each runs again after the other, so their
    order says nothing across iterations."""
    step = loop_step(src, path, line_a, line_b)
    return step.line if step is not None else None


def loop_step(src: SourceFacts, path: str, line_a: int, line_b: int) -> Step | None:
    """The innermost loop whose body holds both lines (its statement, with the collective
    calls its body shows), else None."""
    got = _paths(src, path, line_a, line_b)
    if got is None:
        return None
    pa, pb = got
    found = None
    for k, (sa, sb) in enumerate(zip(pa, pb, strict=False)):
        if sa != sb:
            break
        if sa.kind in _LOOPS and len(pa) > k + 1 and len(pb) > k + 1 \
                and pa[k + 1].field == pb[k + 1].field == "body":
            found = sa
    return found


def function_step(src: SourceFacts, path: str, line: int) -> Step | None:
    """The function whose body holds the line (its ``def``, with the collective calls its
    body shows), else None (module level)."""
    lf = src.line(path, line)
    if lf is None:
        return None
    return next((s for s in reversed(lf.path[:-1])
                 if s.kind in ("FunctionDef", "AsyncFunctionDef")), None)


def in_loop(src: SourceFacts, path: str, line: int) -> bool:
    """The line is inside the body of a ``for``/``while`` loop of its file."""
    return loop_step(src, path, line, line) is not None


def left_loop(src: SourceFacts, path: str, ahead: int, behind: int) -> int | None:
    """The line of a ``for``/``while`` loop that holds ``behind`` but that ``ahead`` is past
    (a later statement of the same block): one rank left the loop while the other is still
    in it — they ran different numbers of iterations. None when that is not what the source
    says."""
    got = _paths(src, path, ahead, behind)
    if got is None:
        return None
    pa, pb = got
    for k, (sa, sb) in enumerate(zip(pa, pb, strict=False)):
        if sa.block != sb.block:
            return None  # two blocks of one statement: not "after the loop"
        if sa.index == sb.index:
            continue
        if sa.index < sb.index:
            return None  # ahead is not past it
        for st in pb[k:]:
            if st.kind in _LOOPS and behind != st.line:
                return st.line
        return None
    return None


def rank_condition(src: SourceFacts, path: str, line: int) -> str | None:
    """``if rank == 0`` when ``line`` runs only under a condition on the rank (its body, or
    ``if not (...)`` for its ``else``), as the capture read it; else None."""
    lf = src.line(path, line)
    return lf.rank_condition if lf is not None else None


def _condition_frame(src: SourceFacts, frames: list[Frame]
                     ) -> tuple[Frame, LineFacts] | None:
    """The outermost user frame on a call path (frames innermost first, as py-spy and the
    recorder give them) whose line runs under a rank condition, with its facts: the ``if
    rank == 0:`` around the call, not one inside the callee."""
    for f in reversed(frames):
        if not is_library_frame(f) and (lf := src.line(f.file, f.line)) is not None \
                and lf.rank_condition is not None:
            return f, lf
    return None


def path_condition(src: SourceFacts, frames: list[Frame]) -> str | None:
    """The rank condition on a call path (:func:`_condition_frame`); else None."""
    got = _condition_frame(src, frames)
    return got[1].rank_condition if got is not None else None


def path_condition_site(src: SourceFacts, frames: list[Frame]) -> Frame | None:
    """Where the condition :func:`path_condition` finds is: the line of its ``if`` (None:
    none, or a capture from before that line was recorded)."""
    got = _condition_frame(src, frames)
    if got is None or (line := got[1].rank_condition_line) is None:
        return None
    return Frame(got[0].file, line, got[0].function)


def _excludes(e: ast.expr) -> bool:
    if isinstance(e, ast.UnaryOp) and isinstance(e.op, ast.Not):
        return not _excludes(e.operand)
    if isinstance(e, ast.Compare):
        return all(isinstance(o, (ast.NotEq, ast.NotIn)) for o in e.ops)
    if isinstance(e, ast.BoolOp) and isinstance(e.op, ast.And):
        return any(_excludes(v) for v in e.values)
    return False


def excludes_ranks(cond: str) -> bool:
    """A condition from :func:`rank_condition` that every rank but the ones it names takes
    (``if rank != 3``, the ``else`` of ``if rank == 0``): the named ranks skip what runs
    under it; they are not the ones that run something extra."""
    e = _parsed(cond)
    return e is not None and _excludes(e)


# the names that hold the global rank itself (not a flag such as ``is_main``, nor a node's
# ``local_rank``, which other nodes' ranks share)
_GLOBAL_RANK = re.compile(r"(?:global_|my_|get_|get_global_)?rank|RANK|process_index")
_COMPARE: dict[type, Callable[[Any, Any], bool]] = {
    ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le,
    ast.Gt: operator.gt, ast.GtE: operator.ge, ast.In: lambda a, b: a in b,
    ast.NotIn: lambda a, b: a not in b}
_ARITH: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mod: operator.mod,
    ast.FloorDiv: operator.floordiv, ast.Mult: operator.mul}


def _value(e: ast.expr, rank: int) -> Any:
    """The value of ``e`` for this rank, or None where it needs anything else (the world
    size, a flag computed at run time)."""
    if isinstance(e, ast.Constant) and isinstance(e.value, int | bool):
        return e.value
    if isinstance(e, ast.Name | ast.Attribute | ast.Call) and _GLOBAL_RANK.fullmatch(
            ast.unparse(e).rsplit(".", 1)[-1].removesuffix("()")):
        return rank
    if isinstance(e, ast.Tuple | ast.List | ast.Set):
        items = [_value(x, rank) for x in e.elts]
        if any(x is None for x in items):
            return None
        return set(items) if isinstance(e, ast.Set) else tuple(items)
    if isinstance(e, ast.BinOp) and type(e.op) in _ARITH:
        a, b = _value(e.left, rank), _value(e.right, rank)
        return None if a is None or b is None or (b == 0 and isinstance(
            e.op, ast.Mod | ast.FloorDiv)) else _ARITH[type(e.op)](a, b)
    if isinstance(e, ast.Compare) and all(type(o) in _COMPARE for o in e.ops):
        vals = [_value(x, rank) for x in (e.left, *e.comparators)]
        if any(v is None for v in vals):
            return None
        return all(_COMPARE[type(o)](a, b)
                   for o, a, b in zip(e.ops, vals, vals[1:], strict=False))
    if isinstance(e, ast.UnaryOp) and isinstance(e.op, ast.Not):
        v = _value(e.operand, rank)
        return None if v is None else not v
    if isinstance(e, ast.BoolOp):
        vs = [_value(x, rank) for x in e.values]
        known = [bool(v) for v in vs if v is not None]
        want = isinstance(e.op, ast.Or)  # or: any True decides; and: any False decides
        if want in known:
            return want
        return None if len(known) < len(vs) else not want
    return None


def holds(cond: str, rank: int) -> bool | None:
    """Does this rank take the branch of a condition from :func:`rank_condition` (``if RANK
    > 0`` for rank 2: True)? None where the condition needs more than the rank to decide
    (or is not one this evaluator reads: a name ``rank`` bound to a subgroup's rank reads as
    the global one — where that errs, :func:`taken_only_by` only drops a source reading)."""
    e = _parsed(cond)
    return None if e is None else _holds(e, rank)


def _parsed(cond: str) -> ast.expr | None:
    try:
        return ast.parse(cond.removeprefix("if "), mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):  # a capture's odd text
        return None


def _holds(e: ast.expr, rank: int) -> bool | None:
    try:
        v = _value(e, rank)
    except TypeError:  # ``rank < (1, 2)``: not decided here
        return None
    return None if v is None else bool(v)


def taken_only_by(cond: str, ranks: Iterable[int], others: Iterable[int]) -> bool:
    """Can the condition be the branch these ranks take and the others do not — False where
    it decides that one of the others takes it too (``if RANK > 0`` in a pipeline), or one
    of these does not. Parsed once, evaluated per rank."""
    e = _parsed(cond)
    if e is None:
        return True
    return not any(_holds(e, r) is True for r in others) and \
        not any(_holds(e, r) is False for r in ranks)


def enclosing_loop(src: SourceFacts, path: str, line: int) -> str | None:
    """The header of the innermost ``for``/``while`` loop whose body holds ``line``
    (``for expert in self.experts``), else None."""
    step = loop_step(src, path, line, line)
    return step.header if step is not None else None


def module_group(src: SourceFacts, path: str, line: int) -> str | None:
    """The group the collective at ``line`` passes, where the module names it once at its
    top level (the same object on every line that passes that name); None: not known."""
    lf: LineFacts | None = src.line(path, line)
    return lf.group if lf is not None else None


def on_default_group(src: SourceFacts, path: str, line: int) -> bool | None:
    """Does the collective called at ``line`` run on the default group (no ``group=``)?
    None when the source does not say."""
    lf: LineFacts | None = src.line(path, line)
    return lf.default_group if lf is not None else None


def on_every_rank(src: SourceFacts, path: str, line: int) -> bool | None:
    """Does the collective called at ``line`` run on a group of every rank (the default
    group, or one the module creates once over every rank)? None when the source does not
    say."""
    lf: LineFacts | None = src.line(path, line)
    if lf is None:
        return None
    # a capture stored before the fact was kept: the default group alone is known
    return lf.every_rank if lf.every_rank is not None else lf.default_group


def gates(src: SourceFacts, path: str, line: int) -> tuple[Gate, ...]:
    """The ``if`` statements ``line`` sits in and the guards before it that leave early, in
    its function, nearest first (nothing where the source was not read)."""
    lf = src.line(path, line)
    return lf.gates if lf is not None else ()


def branch_call(src: SourceFacts, at: Frame) -> Frame | None:
    """The one collective call on the default group of the innermost loop's body around
    ``at`` that a branch decides (an ``if``, a guard, a rank condition): where a rank's
    extra or skip on that group is, when the body has just one such call. Only on the
    default group: the source tells a call with no ``group=`` apart, other groups' names do
    not map to the recorder's."""
    body = loop_step(src, at.file, at.line, at.line)
    if body is None:
        return None
    found = [ln for ln in body.calls if ln != at.line
             and (lf := src.line(at.file, ln)) is not None and lf.default_group is True
             and (lf.rank_condition is not None or any(g.line > body.line for g in lf.gates))]
    return Frame(at.file, found[0], at.function) if len(found) == 1 else None


def loop_targets(header: str | None) -> list[str]:
    """A ``for`` header's target names (``for step, (x, y) in ...``: step, x, y)."""
    target = (header or "").removeprefix("for ").split(" in ", 1)[0]
    return [n.strip(" ()") for n in target.split(",") if n.strip(" ()").isidentifier()]


def loop_counters(lf: LineFacts | None) -> set[str]:
    """The target names of every ``for`` loop around a line (its counters and items)."""
    return {n for st in (lf.path if lf is not None else ()) if st.kind == "For"
            for n in loop_targets(st.header)}


def _names(test: str) -> set[str]:
    """The names a test reads (none where it does not parse)."""
    try:
        return {n.id for n in ast.walk(ast.parse(test, mode="eval")) if isinstance(n, ast.Name)}
    except SyntaxError:
        return set()


def alike_in_a_pass(test: str, counters: Iterable[str]) -> bool:
    """A test that reads only the loop's counters, constants (``ACCUM``) and literals: the
    same on every rank in one pass."""
    try:
        tree = ast.parse(test, mode="eval")
    except SyntaxError:
        return False
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    calls = any(isinstance(n, ast.Call | ast.Attribute | ast.Subscript) for n in ast.walk(tree))
    return not calls and all(n in counters or n.isupper() for n in names)


def periodic_gate(src: SourceFacts, path: str, line: int) -> Gate | None:
    """The ``if`` around ``line`` (or a guard before it) whose test reads a counter of a
    loop around it and otherwise only constants (``if step % 4 == 0:``), where every gate on
    the way is alike in a pass: every rank decides whether it gets there alike in one pass,
    so a collective there comes due only at some passes — ranks that disagree on it are in
    different passes. None where the source shows none, or a gate tests the rank's data."""
    lf = src.line(path, line)
    if lf is None or lf.rank_condition is not None:  # a constant may be the rank's own
        return None
    counters = loop_counters(lf)
    if not all(alike_in_a_pass(g.test, counters) for g in lf.gates):
        return None
    return next((g for g in lf.gates if _names(g.test) & counters), None)


def every_pass(src: SourceFacts, b: Frame, a: Frame) -> bool:
    """Every pass of the innermost loop holding ``a`` and ``b`` posts ``b``'s collective:
    its statement sits right in the loop's body (one inside an inner loop, a ``try``, a
    ``with`` or an ``if`` may run no time in a pass), no guard before it leaves the pass
    early, no rank condition."""
    body = loop_step(src, b.file, b.line, a.line)
    lf = src.line(b.file, b.line)
    if body is None or lf is None:
        return False
    at = next((i for i, st in enumerate(lf.path) if st.line == body.line), None)
    if at is None or len(lf.path) != at + 2 or lf.path[at + 1].field != "body":
        return False
    return rank_condition(src, b.file, b.line) is None and not any(
        g.line > body.line for g in gates(src, b.file, b.line))
