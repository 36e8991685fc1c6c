"""Read the job's source for the lines of a capture, when the capture is made, into
:class:`~moe_hang.evidence.source.SourceFacts` (docs/DESIGN.md §8): each line's statement path,
the rank condition it runs under, whether the collective it calls runs on the default group.

It reads files and parses them (``ast``), never runs them. It runs where the job's files are
(the capturing machine, each node for its own ranks); the analysis then asks the records
only. Library frames (torch, the interpreter's) are not read: only the job's own lines.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterable
from pathlib import Path

from moe_hang.capture.helpers import loop_helpers, posting_functions
from moe_hang.capture.source_calls import (
    appended_last,
    assigned_once,
    called,
    collective_calls,
    default_group,
    every_rank,
    every_rank_groups,
    group_name,
    p2p_calls,
    posted_by,
    wait_calls,
    wait_on_collective,
    waits_at,
)
from moe_hang.evidence.model import Evidence
from moe_hang.evidence.source import RANK_WORDS, Gate, LineFacts, SourceFacts, Step
from moe_hang.evidence.stacks import Frame, is_library_frame, is_stdlib_frame

# files larger than this are not read (a generated file; nothing a person wrote to train)
MAX_SOURCE_BYTES = 4 << 20


def evidence_frames(ev: Evidence) -> Iterable[Frame]:
    """Every frame the analysis may ask about: stacks, recorder and logged collectives,
    heartbeats' samples and pending entries, exceptions."""
    for r in ev.ranks.values():
        for t in r.threads or []:
            yield from t.frames
        if r.fr is not None:
            for c in r.fr.entries:
                yield from c.frames
            for p in r.fr.p2p:
                yield from p.frames
        for rec in r.records:
            yield from rec.frames
        for c in r.posted_log:
            yield from c.frames
        if r.heartbeat is not None:
            yield from r.heartbeat.frames()
        if r.error is not None:
            yield from r.error.frames
        if r.fatal:
            from moe_hang.evidence.stacks import parse_faulthandler
            for t in parse_faulthandler(r.fatal):
                yield from t.frames


def read_facts(frames: Iterable[Frame], skip: Iterable[str] = ()) -> SourceFacts:
    """The facts of every user line among ``frames`` whose file can be read here (but the
    files in ``skip``)."""
    wanted: dict[str, set[int]] = {}
    skipped = set(skip)
    for f in frames:
        if f.line > 0 and not is_library_frame(f) and not is_stdlib_frame(f) \
                and f.file not in skipped:
            wanted.setdefault(f.file, set()).add(f.line)
    out = SourceFacts()
    for file, lines in wanted.items():
        tree = _parse(file)
        if tree is None:
            continue
        names, calls, p2p = _rank_names(tree), collective_calls(tree), p2p_calls(tree)
        once, posting = assigned_once(tree), posting_functions(tree)
        everyone = every_rank_groups(tree, once)
        waits = wait_calls(tree)
        posted = {n: p for n in lines if (p := posted_by(tree, waits, calls, n)) is not None}
        last = {n: p for n in lines if (p := appended_last(tree, waits, calls, n)) is not None}
        # the line a wait's collective was posted from is read too: its branch, its group;
        # and every collective call of a loop around a line (what a pass posts, and under
        # which branch: a skip or an extra one pass earlier is at one of them), its
        # ways out (the branch a rank that left it early took), and its sends and recvs
        # (where a rank's peer answers the one it waits in)
        lines = set(lines) | {p[0] for p in (*posted.values(), *last.values())} | {
            c for n in lines for st in _path(tree.body, n, calls, p2p, posting)
            if st.kind in ("For", "While", "AsyncFor")
            for c in (*st.calls, *st.exits, *(ln for ln, _ in st.p2p),
                      *(ln for h in st.helpers for ln in h[:2]))}
        out.files[file] = {n: LineFacts(tuple(_path(tree.body, n, calls, p2p, posting)),
                                        (cond := _rank_condition(tree, n, names))[0],
                                        default_group(calls, n), waits_at(waits, n),
                                        posted.get(n), (g := group_name(calls, n, once)),
                                        every_rank(calls, n, g, everyone), _gates(tree, n),
                                        wait_on_collective(tree, waits, calls, n), cond[1],
                                        last.get(n), called(calls, n))
                           for n in sorted(lines)}
    return out


def record(ev: Evidence) -> SourceFacts:
    """Read the facts for ``ev``'s frames and attach them (merged over any it carries)."""
    got = read_facts(evidence_frames(ev))
    if ev.source is None:
        ev.source = got
    else:
        ev.source.merge(got)
    return ev.source


def complete(ev: Evidence) -> None:
    """Post mortem (``analyze``): the facts of the files no capture stored facts for — torch's
    own dumps carry none — read from this machine where the job's files are; a file a capture
    stored facts for keeps them (it may have changed since)."""
    known = set(ev.source.files) if ev.source is not None else set()
    got = read_facts(evidence_frames(ev), skip=known)
    if ev.source is None:
        ev.source = got
    else:
        ev.source.merge(got)


def loop_targets(file: str, line: int) -> frozenset[str]:
    """The names a ``for`` loop around ``line`` of ``file`` binds (``for step in ...``,
    ``for i, batch in ...``): the locals of a frame that say which iteration it is in."""
    tree = _cached_parse(file)
    if tree is None:
        return frozenset()
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.For, ast.AsyncFor)) and \
                node.lineno <= line <= (node.end_lineno or node.lineno):
            names.update(n.id for n in ast.walk(node.target) if isinstance(n, ast.Name))
    return frozenset(names)


def waits_on_collective(file: str, line: int) -> bool:
    """``line`` of ``file`` waits on collectives posted earlier, as the source shows it
    (:func:`~moe_hang.capture.source_calls.wait_on_collective` is True): the one fact the
    capture stores as ``LineFacts.wait_on``, read here for the progress window."""
    try:
        return _waits_on_collective(file, line, Path(file).stat().st_mtime_ns)
    except OSError:
        return False


@functools.lru_cache(maxsize=256)
def _waits_on_collective(file: str, line: int, mtime_ns: int) -> bool:
    tree = _parse_at(file, mtime_ns)
    if tree is None:
        return False
    return wait_on_collective(tree, wait_calls(tree), collective_calls(tree), line) is True


@functools.lru_cache(maxsize=64)
def _parse_at(path: str, mtime_ns: int) -> ast.Module | None:
    return _parse(path)


def _cached_parse(path: str) -> ast.Module | None:
    try:
        return _parse_at(path, Path(path).stat().st_mtime_ns)
    except OSError:
        return None


def _parse(path: str) -> ast.Module | None:
    try:
        p = Path(path)
        if not p.is_file() or p.stat().st_size > MAX_SOURCE_BYTES:
            return None
        return ast.parse(p.read_text(encoding="utf-8"), filename=path)
    except (OSError, SyntaxError, ValueError, UnicodeDecodeError, RecursionError):
        return None


# ------------------------------------------------------------------------ statement paths


_REPEATED = (ast.For, ast.AsyncFor, ast.While, ast.FunctionDef, ast.AsyncFunctionDef)


def _path(body: list[ast.stmt], line: int, calls: list[ast.Call],
          p2p: list[tuple[int, str]], posting: dict[str, tuple[int, str, str]]) -> list[Step]:
    out: list[Step] = []
    block: list[ast.stmt] | None = body
    key, fld = "module", "body"
    while block:
        for i, st in enumerate(block):
            end = getattr(st, "end_lineno", st.lineno) or st.lineno
            if st.lineno <= line <= end:
                rep = isinstance(st, _REPEATED)
                inside = tuple(sorted({c.lineno for c in calls
                                       if st.lineno < c.lineno <= end})) if rep else ()
                sends = tuple(p for p in p2p if st.lineno < p[0] <= end) if rep else ()
                helpers = loop_helpers(st, posting) if rep else ()
                out.append(Step(key, i, fld, type(st).__name__, st.lineno, _header(st),
                                inside, end, _exits(st), sends, helpers))
                inner = _inner_block(st, line)
                if inner is None:
                    block = None
                else:
                    block, fld = inner
                    key = f"{st.lineno}:{st.col_offset}:{fld}"
                break
        else:
            break
    return out


def _exits(st: ast.stmt) -> tuple[int, ...]:
    """A loop's ways out before its end: the lines of its own ``break`` statements and of the
    ``return`` statements in its body (none of a function or class defined in it; a nested
    loop's ``break`` leaves only that loop)."""
    if not isinstance(st, (ast.For, ast.AsyncFor, ast.While)):
        return ()
    out: list[int] = []

    def walk(node: ast.AST, own: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef,
                                  ast.Lambda)):
                continue
            if isinstance(child, ast.Return) or (own and isinstance(child, ast.Break)):
                out.append(child.lineno)
            inner = isinstance(child, (ast.For, ast.AsyncFor, ast.While))
            walk(child, own and not inner)

    for part in st.body:
        walk(ast.Module(body=[part], type_ignores=[]), True)
    return tuple(sorted(set(out)))


def _header(st: ast.stmt) -> str | None:
    if isinstance(st, (ast.For, ast.AsyncFor)):
        return f"for {ast.unparse(st.target)} in {ast.unparse(st.iter)}"
    if isinstance(st, ast.While):
        return f"while {ast.unparse(st.test)}"
    return None


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


# ------------------------------------------------------------------------ rank conditions

# names that say "which rank am I" in a condition (torch, torchrun, accelerate, Lightning, ...)

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
        RANK_WORDS.search(ast.unparse(e)))


def _rank_names(tree: ast.Module) -> set[str]:
    """Module-level names bound to a test of the rank (``IS_MAIN = rank == 0``, ``FAULTY =
    RANK in bad``): a condition on them is a condition on the rank."""
    out: set[str] = set()
    for st in tree.body:
        if isinstance(st, ast.Assign) and RANK_WORDS.search(ast.unparse(st.value)) \
                and _is_flag(st.value):
            out.update(t.id for t in st.targets if isinstance(t, ast.Name))
    return out


def _owners(body: list[ast.stmt], line: int) -> list[tuple[ast.stmt, str]]:
    """Each compound statement holding ``line``, with the field of it that holds it."""
    out: list[tuple[ast.stmt, str]] = []
    block: list[ast.stmt] | None = body
    while block:
        for st in block:
            end = getattr(st, "end_lineno", st.lineno) or st.lineno
            if st.lineno <= line <= end:
                inner = _inner_block(st, line)
                if inner is None:
                    block = None
                else:
                    block = inner[0]
                    out.append((st, inner[1]))
                break
        else:
            break
    return out


def _rank_condition(tree: ast.Module, line: int, names: set[str]
                    ) -> tuple[str | None, int | None]:
    """``if rank == 0`` (its source) when ``line`` runs only under a condition on the rank —
    the innermost ``if`` whose test names the rank (or a module-level name set from it), the
    line in its body or ``else``; or a guard before it in the same block that leaves the
    block on such a condition (``if rank == bad and step == 3: continue``): ``if not (...)``;
    with the line of that ``if``. (None, None) where there is none."""
    owners = _owners(tree.body, line)
    blocks: list[list[ast.stmt]] = [tree.body]
    for st, _fld in owners:
        inner = _inner_block(st, line)
        blocks.append(inner[0] if inner is not None else [])
    for depth in range(len(owners), -1, -1):  # innermost first
        for st in blocks[depth]:
            if st.lineno > line or (getattr(st, "end_lineno", st.lineno) or st.lineno) >= line:
                break  # the statement that holds the line, and what follows it
            if (test := _guard_test(st, names)) is not None:
                return f"if not ({test})", st.lineno
        if depth == 0:
            break
        st, fld = owners[depth - 1]
        if isinstance(st, ast.If) and (test := _rank_test(st.test, names)) is not None:
            return (f"if {test}" if fld == "body" else f"if not ({test})"), st.lineno
    return None, None


_LEAVES = {ast.Return: "return", ast.Continue: "continue", ast.Break: "break",
           ast.Raise: "raise"}


def _gates(tree: ast.Module, line: int) -> tuple[Gate, ...]:
    """The ``if`` statements ``line`` sits in, and the guards before it in its blocks that
    leave early (``if TEST: return``, no ``else``), inside its innermost function (or the
    module's top level), nearest first."""
    owners = _owners(tree.body, line)
    blocks: list[list[ast.stmt]] = [tree.body]
    for st, _fld in owners:
        inner = _inner_block(st, line)
        blocks.append(inner[0] if inner is not None else [])
    out: list[Gate] = []
    for depth in range(len(owners), -1, -1):  # innermost first
        before = [st for st in blocks[depth]
                  if (getattr(st, "end_lineno", st.lineno) or st.lineno) < line]
        for st in reversed(before):
            if isinstance(st, ast.If) and not st.orelse and st.body \
                    and (how := _LEAVES.get(type(st.body[-1]))) is not None:
                out.append(Gate(st.lineno, st.end_lineno or st.lineno,
                                ast.unparse(st.test), how))
            elif isinstance(st, ast.Try):  # a try before it whose handler leaves: a guard
                out += _handlers(st)
        if depth == 0:
            break
        st, fld = owners[depth - 1]
        if isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef)):
            break  # the gates of the function's callers are the callers' lines'
        if isinstance(st, ast.Try) and fld == "body":
            out += _handlers(st)
        if isinstance(st, ast.If) and fld in ("body", "orelse"):
            out.append(Gate(st.lineno, st.end_lineno or st.lineno, ast.unparse(st.test),
                            "if" if fld == "body" else "else"))
    return tuple(out)


def _handlers(st: ast.Try) -> list[Gate]:
    """The handlers of a ``try`` that leave (``except RuntimeError: ... continue``): where
    its body raises, what follows is not reached in that pass or call — how is
    ``except-continue`` (``-break``, ``-return``); the test is the exception caught."""
    return [Gate(h.lineno, h.end_lineno or h.lineno,
                 ast.unparse(h.type) if h.type is not None else "", f"except-{how}")
            for h in st.handlers if h.body and (how := _LEAVES.get(type(h.body[-1])))
            and how != "raise"]


def _rank_test(e: ast.expr, names: set[str]) -> str | None:
    """``e``'s source, where it names the rank (or a name set from it)."""
    test = ast.unparse(e)
    used = {n.id for n in ast.walk(e) if isinstance(n, ast.Name)}
    return test if RANK_WORDS.search(test) or used & names else None


def _guard_test(st: ast.stmt, names: set[str]) -> str | None:
    """``if TEST: continue`` (``break``, ``return``) on the rank, with no ``else``: the
    statements after it in its block run only where TEST is false."""
    if not isinstance(st, ast.If) or st.orelse or not st.body \
            or not isinstance(st.body[-1], (ast.Continue, ast.Break, ast.Return)):
        return None
    return _rank_test(st.test, names)
