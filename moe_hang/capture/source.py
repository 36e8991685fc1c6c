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
import re
from collections.abc import Iterable
from pathlib import Path

from moe_hang.evidence.model import Evidence
from moe_hang.evidence.source import WAIT_METHODS, LineFacts, SourceFacts, Step
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
        names, calls = _rank_names(tree), _collective_calls(tree)
        once = _assigned_once(tree)
        everyone = _every_rank_groups(tree, once)
        waits = _wait_calls(tree)
        posted = {n: p for n in lines if (p := _posted_by(tree, waits, calls, n)) is not None}
        # the line a wait's collective was posted from is read too: its branch, its group
        lines = set(lines) | {p[0] for p in posted.values()}
        out.files[file] = {n: LineFacts(tuple(_path(tree.body, n, calls)),
                                        _rank_condition(tree, n, names),
                                        _default_group(calls, n), _waits(waits, n),
                                        posted.get(n), (g := _group_name(calls, n, once)),
                                        _every_rank(calls, n, g, everyone))
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


def _path(body: list[ast.stmt], line: int, calls: list[ast.Call]) -> list[Step]:
    out: list[Step] = []
    block: list[ast.stmt] | None = body
    key, fld = "module", "body"
    while block:
        for i, st in enumerate(block):
            end = getattr(st, "end_lineno", st.lineno) or st.lineno
            if st.lineno <= line <= end:
                inside = tuple(sorted({c.lineno for c in calls
                                       if st.lineno < c.lineno <= end})) \
                    if isinstance(st, _REPEATED) else ()
                out.append(Step(key, i, fld, type(st).__name__, st.lineno, _header(st),
                                inside, end))
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


def _rank_condition(tree: ast.Module, line: int, names: set[str]) -> str | None:
    """``if rank == 0`` (its source) when ``line`` runs only under a condition on the rank —
    the innermost ``if`` whose test names the rank (or a module-level name set from it), the
    line in its body or ``else``; or a guard before it in the same block that leaves the
    block on such a condition (``if rank == bad and step == 3: continue``): ``if not (...)``."""
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
                return f"if not ({test})"
        if depth == 0:
            break
        st, fld = owners[depth - 1]
        if isinstance(st, ast.If) and (test := _rank_test(st.test, names)) is not None:
            return f"if {test}" if fld == "body" else f"if not ({test})"
    return None


def _rank_test(e: ast.expr, names: set[str]) -> str | None:
    """``e``'s source, where it names the rank (or a name set from it)."""
    test = ast.unparse(e)
    used = {n.id for n in ast.walk(e) if isinstance(n, ast.Name)}
    return test if _RANK_WORDS.search(test) or used & names else None


def _guard_test(st: ast.stmt, names: set[str]) -> str | None:
    """``if TEST: continue`` (``break``, ``return``) on the rank, with no ``else``: the
    statements after it in its block run only where TEST is false."""
    if not isinstance(st, ast.If) or st.orelse or not st.body \
            or not isinstance(st.body[-1], (ast.Continue, ast.Break, ast.Return)):
        return None
    return _rank_test(st.test, names)


# ------------------------------------------------------------------------ group=

# the torch.distributed calls whose group is their ``group=`` (the default group without it)
_COLLECTIVE_CALLS = frozenset({
    "all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
    "reduce_scatter_tensor", "broadcast", "barrier", "monitored_barrier", "reduce", "gather",
    "scatter", "all_to_all", "all_to_all_single", "all_gather_object", "broadcast_object_list"})


def _collective_calls(tree: ast.Module) -> list[ast.Call]:
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call)
            and (n.func.attr if isinstance(n.func, ast.Attribute)
                 else n.func.id if isinstance(n.func, ast.Name) else None) in _COLLECTIVE_CALLS]


def _default_group(calls: list[ast.Call], line: int) -> bool | None:
    """Does the collective called at ``line`` run on the default group (every rank): a call
    of :data:`_COLLECTIVE_CALLS` with no ``group=`` and no argument past its tensor and op?
    None when the source does not say (no such call, a positional group)."""
    here = [n for n in calls if n.lineno <= line <= (n.end_lineno or n.lineno)]
    if len(here) != 1:
        return None
    call = here[0]
    if any(k.arg in ("group", "process_group") or k.arg is None for k in call.keywords):
        return False
    return True if len(call.args) <= 2 else None


def _assigned_once(tree: ast.Module) -> set[str]:
    """Names the module assigns exactly once, at its top level (``LOG = dist.new_group()``):
    one object wherever the module passes them."""
    top = [t.id for node in tree.body if isinstance(node, (ast.Assign, ast.AnnAssign))
           for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
           if isinstance(t, ast.Name)]
    anywhere = [n.id for n in ast.walk(tree) if isinstance(n, ast.Name)
                and isinstance(n.ctx, ast.Store)]
    return {name for name in top if top.count(name) == 1 and anywhere.count(name) == 1}


def _top_values(tree: ast.Module) -> dict[str, ast.expr]:
    """What each name the module stores exactly once, at its top level, is given
    (``RANK, WORLD = dist.get_rank(), dist.get_world_size()`` too)."""
    stores = [n.id for n in ast.walk(tree) if isinstance(n, ast.Name)
              and isinstance(n.ctx, ast.Store)]
    out: dict[str, ast.expr] = {}
    for node in tree.body:
        if not isinstance(node, ast.Assign) or len(node.targets) != 1:
            continue
        t, v = node.targets[0], node.value
        pairs = (list(zip(t.elts, v.elts, strict=True))
                 if isinstance(t, ast.Tuple) and isinstance(v, ast.Tuple)
                 and len(t.elts) == len(v.elts) else [(t, v)])
        for name, value in pairs:
            if isinstance(name, ast.Name) and stores.count(name.id) == 1:
                out[name.id] = value
    return out


def _called(e: ast.expr | None, name: str) -> bool:
    return isinstance(e, ast.Call) and (
        e.func.attr if isinstance(e.func, ast.Attribute) else
        e.func.id if isinstance(e.func, ast.Name) else None) == name


def _every_rank_groups(tree: ast.Module, once: set[str]) -> set[str]:
    """The group names the module assigns once, at its top level, to a ``new_group`` of
    every rank: no ranks given, or ``range(W)`` / ``list(range(W))`` of the world size
    (``W = dist.get_world_size()``, assigned once at the top)."""
    values = _top_values(tree)

    def world(e: ast.expr) -> bool:
        if _called(e, "get_world_size"):
            return True
        return isinstance(e, ast.Name) and _called(values.get(e.id), "get_world_size")

    def all_ranks(e: ast.expr | None) -> bool:
        if e is None or (isinstance(e, ast.Constant) and e.value is None):
            return True
        if _called(e, "list") and isinstance(e, ast.Call) and len(e.args) == 1:
            e = e.args[0]
        return (_called(e, "range") and isinstance(e, ast.Call) and len(e.args) == 1
                and not e.keywords and world(e.args[0]))

    out = set()
    for name in once:
        v = values.get(name)
        if not _called(v, "new_group") or not isinstance(v, ast.Call):
            continue
        ranks = v.args[0] if v.args else next(
            (k.value for k in v.keywords if k.arg == "ranks"), None)
        if all_ranks(ranks):
            out.add(name)
    return out


def _every_rank(calls: list[ast.Call], line: int, group: str | None,
                everyone: set[str]) -> bool | None:
    """Does the collective at ``line`` run on a group of every rank: the default group, or a
    name the module binds once to a group of every rank? False where it passes another
    group (or one the source cannot place); None when the source does not say."""
    dg = _default_group(calls, line)
    if dg is True or (group is not None and group in everyone):
        return True
    return False if dg is False else None


def _group_name(calls: list[ast.Call], line: int, once: set[str]) -> str | None:
    """The group the collective at ``line`` passes (``group=LOG``), where it is a name the
    module assigns once at its top level."""
    here = [n for n in calls if n.lineno <= line <= (n.end_lineno or n.lineno)]
    if len(here) != 1:
        return None
    got = next((k.value for k in here[0].keywords if k.arg in ("group", "process_group")),
               None)
    return got.id if isinstance(got, ast.Name) and got.id in once else None


def _wait_calls(tree: ast.Module) -> list[ast.Call]:
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call)
            and isinstance(n.func, ast.Attribute) and n.func.attr in WAIT_METHODS]


def _waits(calls: list[ast.Call], line: int) -> str | None:
    """The wait called at ``line`` (``work.wait()``: "wait"), where one is."""
    here = [n for n in calls if n.lineno <= line <= (n.end_lineno or n.lineno)]
    return here[0].func.attr if len(here) == 1 and isinstance(here[0].func, ast.Attribute) \
        else None


def _posted_by(tree: ast.Module, waits: list[ast.Call], calls: list[ast.Call], line: int
               ) -> tuple[int, str] | None:
    """The collective whose result the wait at ``line`` waits on: ``NAME.wait()`` where the
    last assignment of ``NAME`` before it, in the same function, is a collective call
    (``NAME = dist.all_reduce(x, async_op=True)``)."""
    here = [n for n in waits if n.lineno <= line <= (n.end_lineno or n.lineno)]
    if len(here) != 1 or not isinstance(here[0].func, ast.Attribute) \
            or not isinstance(here[0].func.value, ast.Name):
        return None
    name = here[0].func.value.id
    scope: ast.AST = tree
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and \
                node.lineno <= line <= (node.end_lineno or node.lineno) and \
                node.lineno >= getattr(scope, "lineno", 0):
            scope = node
    found: tuple[int, str] | None = None
    for node in ast.walk(scope):
        if isinstance(node, ast.Assign) and node.lineno < line and \
                any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            call = node.value
            op = (call.func.attr if isinstance(call.func, ast.Attribute) else
                  call.func.id if isinstance(call.func, ast.Name) else None) \
                if isinstance(call, ast.Call) else None
            if found is None or node.lineno > found[0]:
                found = (node.lineno, op) if op in _COLLECTIVE_CALLS and call in calls \
                    else None
    return found
