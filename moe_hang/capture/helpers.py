"""The functions of a module a loop calls that post collectives, for
:mod:`moe_hang.capture.source`: a rank-only evaluation or checkpoint is a helper called under a
branch, and what it posts (FSDP2's all-gathers, a logging all-reduce) does not name
torch.distributed at the loop's line. Where a recorder keeps no call stacks, this is what says
where such a rank's extra collectives came from. Reads ``ast`` only.
"""

from __future__ import annotations

import ast

from moe_hang.capture.source_calls import COLLECTIVE_CALLS

# (the loop's call line, the posting line, the callee, the op, ``fsdp`` where FSDP2 posts it
# else the torch.distributed function called)
Helper = tuple[int, int, str, str, str]


def _fsdp_modules(tree: ast.Module) -> set[str]:
    """The names the module passes to FSDP2's ``fully_shard``: calling one runs its forward,
    whose pre-hook all-gathers its parameters."""
    return {n.args[0].id for n in ast.walk(tree) if isinstance(n, ast.Call) and n.args
            and isinstance(n.args[0], ast.Name)
            and (n.func.attr if isinstance(n.func, ast.Attribute) else
                 n.func.id if isinstance(n.func, ast.Name) else None) == "fully_shard"}


def _op(n: ast.Call, fsdp: set[str]) -> tuple[str, str] | None:
    """The collective a call posts and how: a torch.distributed collective by name (the
    function); FSDP2's ``unshard()`` and a call of a module passed to ``fully_shard``
    all-gather (``fsdp``)."""
    f = n.func
    name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
    if name in COLLECTIVE_CALLS:
        return name, name
    if (name == "unshard" and isinstance(f, ast.Attribute) and not n.args) \
            or (isinstance(f, ast.Name) and name in fsdp):
        return "all_gather", "fsdp"
    return None


def posting_functions(tree: ast.Module) -> dict[str, tuple[int, str, str]]:
    """Each module-level function whose body posts a collective: its first posting line, that
    call's op and how it posts (:func:`_op`)."""
    fsdp = _fsdp_modules(tree)
    out: dict[str, tuple[int, str, str]] = {}
    for st in tree.body:
        if isinstance(st, ast.FunctionDef | ast.AsyncFunctionDef):
            posts = sorted((n.lineno, *op) for n in ast.walk(st)
                           if isinstance(n, ast.Call) and (op := _op(n, fsdp)) is not None)
            if posts:
                out[st.name] = posts[0]
    return out


def loop_helpers(st: ast.stmt, posting: dict[str, tuple[int, str, str]]
                 ) -> tuple[Helper, ...]:
    """The calls in a loop's body of a function of the module that posts collectives."""
    end = getattr(st, "end_lineno", st.lineno) or st.lineno
    found: set[Helper] = set()
    for n in ast.walk(st):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) \
                and n.func.id in posting and st.lineno < n.lineno <= end:
            line, op, how = posting[n.func.id]
            found.add((n.lineno, line, n.func.id, op, how))
    return tuple(sorted(found))
