"""Which of two lines of the same function runs first: from the source itself (pure; reads
the file, never runs it).

Line numbers alone mislead: in ``if rank == 0: a() else: b()`` the ``else`` branch has the
higher line, yet neither rank is "further along" — they took exclusive branches. So two lines
are ordered only when, in the innermost block holding both, they sit in different statements
of that same block; lines in different branches of one ``if``/``try``/``match`` are not
ordered. Without the source (another machine), the line numbers are used and the caller is
told the order is unconfirmed.
"""

from __future__ import annotations

import ast
import functools
import os
import re
from enum import Enum

from moe_hang.evidence.stacks import Frame, is_library_frame


class Order(Enum):
    A_FIRST = "a"
    B_FIRST = "b"
    EXCLUSIVE = "exclusive"  # different branches of one statement: neither is "after"
    SAME = "same"
    UNKNOWN = "unknown"


@functools.lru_cache(maxsize=64)
def _parse(path: str, mtime: float) -> ast.Module | None:
    try:
        with open(path, encoding="utf-8") as f:
            return ast.parse(f.read(), filename=path)
    except (OSError, SyntaxError, ValueError, UnicodeDecodeError):
        return None


def _tree(path: str) -> ast.Module | None:
    try:
        return _parse(path, os.path.getmtime(path))
    except OSError:
        return None


def _path_to(body: list[ast.stmt], line: int) -> list[tuple[int, int, str, ast.stmt]]:
    """(id of the block, index in it, which field of its parent statement holds the block,
    the statement) from the outermost block down to the statement that holds ``line``."""
    out: list[tuple[int, int, str, ast.stmt]] = []
    block: list[ast.stmt] | None = body
    field = "body"
    while block:
        for i, st in enumerate(block):
            end = getattr(st, "end_lineno", st.lineno) or st.lineno
            if st.lineno <= line <= end:
                out.append((id(block), i, field, st))
                inner = _inner_block(st, line)
                block, field = inner if inner else (None, "")
                break
        else:
            break
    return out


def _inner_block(st: ast.stmt, line: int) -> tuple[list[ast.stmt], str] | None:
    for name in ("body", "orelse", "finalbody", "handlers", "cases"):
        sub = getattr(st, name, None)
        if not isinstance(sub, list) or not sub:
            continue
        blocks: list[list[ast.stmt]] = [sub]
        if name in ("handlers", "cases"):  # except handlers / match cases carry bodies
            blocks = [getattr(h, "body", []) for h in sub]
        for i, b in enumerate(blocks):
            if b and b[0].lineno <= line <= (getattr(b[-1], "end_lineno", None) or line):
                return b, f"{name}{i}" if name in ("handlers", "cases") else name
    return None


# In one statement, which of its blocks run one after the other (the rest are exclusive):
# a loop's or a try's ``else`` after its body, a ``finally`` after everything.
_SEQUENTIAL = {"body": 0, "orelse": 1, "finalbody": 2}


def _between_blocks(st: ast.stmt, fa: str, fb: str) -> Order:
    if isinstance(st, (ast.If, ast.Match)) and "finalbody" not in (fa, fb):
        return Order.EXCLUSIVE
    if fa.startswith(("handlers", "cases")) or fb.startswith(("handlers", "cases")):
        if "finalbody" in (fa, fb):
            return Order.A_FIRST if fb == "finalbody" else Order.B_FIRST
        return Order.EXCLUSIVE
    ra, rb = _SEQUENTIAL.get(fa), _SEQUENTIAL.get(fb)
    if ra is None or rb is None or ra == rb:
        return Order.EXCLUSIVE
    return Order.A_FIRST if ra < rb else Order.B_FIRST


def order(path: str, line_a: int, line_b: int) -> Order:
    """How two lines of the same file relate in program order (see the module doc)."""
    if line_a == line_b:
        return Order.SAME
    tree = _tree(path)
    if tree is None:
        return Order.UNKNOWN
    pa, pb = _path_to(tree.body, line_a), _path_to(tree.body, line_b)
    parent: ast.stmt | None = None
    for (ba, ia, fa, sa), (bb, ib, fb, _sb) in zip(pa, pb, strict=False):
        if ba != bb:  # two blocks of the statement above: exclusive or in sequence
            return _between_blocks(parent, fa, fb) if parent is not None else Order.UNKNOWN
        if ia != ib:
            return Order.A_FIRST if ia < ib else Order.B_FIRST
        parent = sa
    # one line holds the other's statement (a compound statement's header vs its body):
    # the header runs first
    if len(pa) != len(pb):
        return Order.A_FIRST if len(pa) < len(pb) else Order.B_FIRST
    return Order.SAME


def in_loop(path: str, line: int) -> bool:
    """The line is inside the body of a ``for``/``while`` loop of its function."""
    tree = _tree(path)
    if tree is None:
        return False
    return any(isinstance(st, (ast.For, ast.While, ast.AsyncFor)) and field == "body"
               for _b, _i, field, st in _inner_statements(tree.body, line))


def _inner_statements(body: list[ast.stmt], line: int) -> list[tuple[int, int, str, ast.stmt]]:
    """Like the path to ``line``, but each entry names the field of *its own* statement
    that holds the next level (so "a statement whose body holds the line")."""
    path = _path_to(body, line)
    return [(b, i, path[k + 1][2], st) for k, (b, i, _f, st) in enumerate(path[:-1])]


def left_loop(path: str, ahead: int, behind: int) -> int | None:
    """The line of a ``for``/``while`` loop that holds ``behind`` but that ``ahead`` is past
    (a later statement of the same block): one rank left the loop while the other is still
    in it — they ran different numbers of iterations. None when that is not what the source
    says."""
    tree = _tree(path)
    if tree is None:
        return None
    pa, pb = _path_to(tree.body, ahead), _path_to(tree.body, behind)
    for k, ((ba, ia, _fa, _sa), (bb, ib, _fb, _sb)) in enumerate(zip(pa, pb, strict=False)):
        if ba != bb:
            return None  # two blocks of one statement: not "after the loop"
        if ia == ib:
            continue
        if ia < ib:
            return None  # ahead is not past it
        for _b, _i, _f, st in pb[k:]:
            if isinstance(st, (ast.For, ast.While, ast.AsyncFor)) and behind != st.lineno:
                return st.lineno
        return None
    return None


# names that say "which rank am I" in a condition (torch, torchrun, accelerate, Lightning, ...)
_RANK_WORDS = re.compile(
    r"\b(\w*rank\w*|RANK|is_main\w*|is_master\w*|is_global_zero|is_local_main\w*|"
    r"main_process\w*|process_index|local_process_index)\b")


def _is_flag(e: ast.expr) -> bool:
    """A test about the rank (``rank == 0``, ``RANK in bad``, ``not is_main``), or a name that
    says it (``accelerator.is_main_process``) — not a value computed from it (``tokens = 0 if
    rank == k else 4``, ``batches[rank::world]``): a condition on such a value is about the
    data (``if tokens > 0:``), and says nothing of who was meant to run the branch."""
    if isinstance(e, ast.Compare | ast.BoolOp):
        return True
    if isinstance(e, ast.UnaryOp) and isinstance(e.op, ast.Not):
        return _is_flag(e.operand)
    return isinstance(e, ast.Name | ast.Attribute | ast.Call) and bool(
        _RANK_WORDS.search(ast.unparse(e)))


def _rank_names(tree: ast.Module) -> set[str]:
    """Module-level names bound to a test of the rank (``IS_MAIN = rank == 0``, ``FAULTY =
    RANK in bad``): a condition on them is a condition on the rank."""
    out: set[str] = set()
    for st in tree.body:
        if isinstance(st, ast.Assign) and _RANK_WORDS.search(ast.unparse(st.value)) \
                and _is_flag(st.value):
            out.update(t.id for t in st.targets if isinstance(t, ast.Name))
    return out


def rank_condition(path: str, line: int) -> str | None:
    """``if rank == 0`` (its source) when ``line`` runs only under a condition on the rank —
    an ``if`` whose test names the rank (or a module-level name set from it), the line in
    its body or ``else`` — else None."""
    tree = _tree(path)
    if tree is None:
        return None
    names = _rank_names(tree)
    for _b, _i, field, st in reversed(_inner_statements(tree.body, line)):
        if not isinstance(st, ast.If):
            continue
        test = ast.unparse(st.test)
        used = {n.id for n in ast.walk(st.test) if isinstance(n, ast.Name)}
        if not _RANK_WORDS.search(test) and not used & names:
            continue
        return f"if {test}" if field == "body" else f"if not ({test})"
    return None


def path_condition(frames: list[Frame]) -> str | None:
    """The rank condition on a call path (frames innermost first, as py-spy and the recorder
    give them), outermost user frame first: the ``if rank == 0:`` around the call, not one
    inside the callee."""
    for f in reversed(frames):
        if not is_library_frame(f) and (c := rank_condition(f.file, f.line)) is not None:
            return c
    return None


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
    try:
        e = ast.parse(cond.removeprefix("if "), mode="eval").body
    except SyntaxError:
        return False
    return _excludes(e)


def enclosing_loop(path: str, line: int) -> str | None:
    """The header of the innermost ``for``/``while`` loop whose body holds ``line``
    (``for expert in self.experts``), else None."""
    tree = _tree(path)
    if tree is None:
        return None
    for _b, _i, field, st in reversed(_inner_statements(tree.body, line)):
        if isinstance(st, (ast.For, ast.AsyncFor)) and field == "body":
            return f"for {ast.unparse(st.target)} in {ast.unparse(st.iter)}"
        if isinstance(st, ast.While) and field == "body":
            return f"while {ast.unparse(st.test)}"
    return None


# the torch.distributed calls whose group is their ``group=`` (the default group without it)
_COLLECTIVE_CALLS = frozenset({
    "all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
    "reduce_scatter_tensor", "broadcast", "barrier", "monitored_barrier", "reduce", "gather",
    "scatter", "all_to_all", "all_to_all_single", "all_gather_object", "broadcast_object_list"})


def on_default_group(path: str, line: int) -> bool | None:
    """Does the collective called at ``line`` run on the default group (every rank): a call
    of :data:`_COLLECTIVE_CALLS` with no ``group=`` and no argument past its tensor and op?
    None when the source does not say (no source, no such call, a positional group)."""
    tree = _tree(path)
    if tree is None:
        return None
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)
             and n.lineno <= line <= (n.end_lineno or n.lineno)
             and (n.func.attr if isinstance(n.func, ast.Attribute)
                  else n.func.id if isinstance(n.func, ast.Name) else None) in _COLLECTIVE_CALLS]
    if len(calls) != 1:
        return None
    call = calls[0]
    if any(k.arg in ("group", "process_group") or k.arg is None for k in call.keywords):
        return False
    return True if len(call.args) <= 2 else None
