"""What a module's collective and wait calls say, for :mod:`moe_hang.capture.source`: the
group a collective passes (the default group, a name bound once to a group of every rank), the
wait a line calls and the collective whose result it waits on. Reads ``ast`` only.
"""

from __future__ import annotations

import ast

from moe_hang.evidence.source import WAIT_METHODS

# the torch.distributed calls whose group is their ``group=`` (the default group without it)
COLLECTIVE_CALLS = frozenset({
    "all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
    "reduce_scatter_tensor", "broadcast", "barrier", "monitored_barrier", "reduce", "gather",
    "scatter", "all_to_all", "all_to_all_single", "all_gather_object", "broadcast_object_list"})


# the point-to-point calls, by the op whose answer a peer waits for (an ``isend`` posts a
# send as ``send`` does; its wait comes later)
P2P_CALLS = {"send": "send", "isend": "send", "recv": "recv", "irecv": "recv"}


def _name(n: ast.Call) -> str | None:
    f = n.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None


def collective_calls(tree: ast.Module) -> list[ast.Call]:
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call) and _name(n) in COLLECTIVE_CALLS]


def p2p_calls(tree: ast.Module) -> list[tuple[int, str]]:
    """Every point-to-point call's line and op (``send``/``recv``)."""
    return sorted({(n.lineno, op) for n in ast.walk(tree) if isinstance(n, ast.Call)
                   and (op := P2P_CALLS.get(_name(n) or "")) is not None})


def called(calls: list[ast.Call], line: int) -> str | None:
    """The one collective called at ``line``, by its function's name."""
    here = [n for n in calls if n.lineno <= line <= (n.end_lineno or n.lineno)]
    return _name(here[0]) if len(here) == 1 else None


def default_group(calls: list[ast.Call], line: int) -> bool | None:
    """Does the collective called at ``line`` run on the default group (every rank): a call
    of :data:`COLLECTIVE_CALLS` with no ``group=`` and no argument past its tensor and op?
    None when the source does not say (no such call, a positional group)."""
    here = [n for n in calls if n.lineno <= line <= (n.end_lineno or n.lineno)]
    if len(here) != 1:
        return None
    call = here[0]
    if any(k.arg in ("group", "process_group") or k.arg is None for k in call.keywords):
        return False
    return True if len(call.args) <= 2 else None


def assigned_once(tree: ast.Module) -> set[str]:
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


def every_rank_groups(tree: ast.Module, once: set[str]) -> set[str]:
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


def every_rank(calls: list[ast.Call], line: int, group: str | None,
                everyone: set[str]) -> bool | None:
    """Does the collective at ``line`` run on a group of every rank: the default group, or a
    name the module binds once to a group of every rank? False where it passes another
    group (or one the source cannot place); None when the source does not say."""
    dg = default_group(calls, line)
    if dg is True or (group is not None and group in everyone):
        return True
    return False if dg is False else None


def group_name(calls: list[ast.Call], line: int, once: set[str]) -> str | None:
    """The group the collective at ``line`` passes (``group=LOG``), where it is a name the
    module assigns once at its top level."""
    here = [n for n in calls if n.lineno <= line <= (n.end_lineno or n.lineno)]
    if len(here) != 1:
        return None
    got = next((k.value for k in here[0].keywords if k.arg in ("group", "process_group")),
               None)
    return got.id if isinstance(got, ast.Name) and got.id in once else None


def wait_calls(tree: ast.Module) -> list[ast.Call]:
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call)
            and isinstance(n.func, ast.Attribute) and n.func.attr in WAIT_METHODS]


def waits_at(calls: list[ast.Call], line: int) -> str | None:
    """The wait called at ``line`` (``work.wait()``: "wait"), where one is."""
    here = [n for n in calls if n.lineno <= line <= (n.end_lineno or n.lineno)]
    return here[0].func.attr if len(here) == 1 and isinstance(here[0].func, ast.Attribute) \
        else None


def _handle_assigns(tree: ast.Module, waits: list[ast.Call], line: int
                    ) -> tuple[list[ast.Assign], ast.AST]:
    """The assignments before ``line``, in its function, of the name the wait at ``line`` is
    called on (``NAME.wait()``), but ``NAME = None``; and that function."""
    here = [n for n in waits if n.lineno <= line <= (n.end_lineno or n.lineno)]
    if len(here) != 1 or not isinstance(here[0].func, ast.Attribute) \
            or not isinstance(here[0].func.value, ast.Name):
        return [], tree
    name, scope = here[0].func.value.id, _scope_of(tree, line)
    # ``h = None`` first, then ``if overlap: h = dist.all_reduce(..., async_op=True)``: the
    # initializer is no post the wait can be on (``if h is not None: h.wait()``)
    return [node for node in ast.walk(scope) if isinstance(node, ast.Assign)
            and node.lineno < line
            and any(isinstance(t, ast.Name) and t.id == name for t in node.targets)
            and not (isinstance(node.value, ast.Constant) and node.value.value is None)], scope


def _collective_op(node: ast.Assign, calls: list[ast.Call]) -> str | None:
    call = node.value
    op = _name(call) if isinstance(call, ast.Call) else None
    return op if op in COLLECTIVE_CALLS and call in calls else None


def posted_by(tree: ast.Module, waits: list[ast.Call], calls: list[ast.Call], line: int
               ) -> tuple[int, str] | None:
    """The collective whose result the wait at ``line`` waits on: ``NAME.wait()`` where the
    last assignment of ``NAME`` before it, in the same function, is a collective call
    (``NAME = dist.all_reduce(x, async_op=True)``)."""
    assigns, scope = _handle_assigns(tree, waits, line)
    if not assigns:
        return _listed_from_one_call(tree, waits, calls, line)
    last = max(assigns, key=lambda n: n.lineno)
    # the last in the text need not be the last that ran: where it sits in a branch the wait
    # is not in, and the name is assigned elsewhere too (``if ...: w = all_gather(...)``
    # ``else: w = all_reduce(...)``), the source does not say which the wait waits on
    branched = any(isinstance(n, ast.If) and n.lineno <= last.lineno <= (n.end_lineno or 0)
                   and not n.lineno <= line <= (n.end_lineno or 0) for n in ast.walk(scope))
    if branched and len(assigns) > 1:
        return None
    op = _collective_op(last, calls)
    return (last.lineno, op) if op is not None else None


def _scope_of(tree: ast.Module, line: int) -> ast.AST:
    """The innermost function ``line`` is in (the module where none)."""
    scope: ast.AST = tree
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and \
                node.lineno <= line <= (node.end_lineno or node.lineno) and \
                node.lineno >= getattr(scope, "lineno", 0):
            scope = node
    return scope


def _waited_list(tree: ast.Module, waits: list[ast.Call], line: int
                 ) -> tuple[str, int, ast.AST] | None:
    """For ``NAME.wait()`` at ``line`` inside ``for NAME in LIST:``: LIST's name, the loop's
    line and the function both are in."""
    here = [n for n in waits if n.lineno <= line <= (n.end_lineno or n.lineno)]
    if len(here) != 1 or not isinstance(here[0].func, ast.Attribute) \
            or here[0].func.attr != "wait" or not isinstance(here[0].func.value, ast.Name):
        return None
    handle, scope = here[0].func.value.id, _scope_of(tree, line)
    loops = [n for n in ast.walk(scope) if isinstance(n, ast.For)
             and isinstance(n.target, ast.Name) and n.target.id == handle
             and isinstance(n.iter, ast.Name) and n.lineno < line <= (n.end_lineno or n.lineno)]
    if len(loops) != 1:
        return None
    return loops[0].iter.id, loops[0].lineno, scope  # type: ignore[attr-defined]


def _listed_from_one_call(tree: ast.Module, waits: list[ast.Call], calls: list[ast.Call],
                          line: int) -> tuple[int, str] | None:
    """A wait on a list's handles (``for w in works: w.wait()``) where every handle the list
    can hold was posted by one collective call: the list is only ever built empty or by a
    comprehension of that call (``works = [dist.all_reduce(g, async_op=True) for g in
    grads]``), and only that call is appended to it (``works.append(dist.all_reduce(...))``
    in a loop over the parameters), in the wait's function; nothing else adds to it. Whichever
    handle the wait is on, it was posted at that call's line."""
    waited = _waited_list(tree, waits, line)
    if waited is None:
        return None
    listed, _start, scope = waited

    def on_list(n: ast.AST) -> bool:
        return isinstance(n, ast.Name) and n.id == listed

    nodes = list(ast.walk(tree))  # the list may be filled anywhere: read every use once
    assigns = [n.value for n in nodes if isinstance(n, ast.Assign)
               and any(on_list(t) for t in n.targets)]
    mutations = [n for n in nodes if isinstance(n, ast.Call)
                 and isinstance(n.func, ast.Attribute) and on_list(n.func.value)
                 and n.func.attr in ("append", "extend", "insert")]
    if not assigns or any(isinstance(n, ast.AugAssign) and on_list(n.target) for n in nodes):
        return None
    posts: list[ast.expr | None] = []
    for v in assigns:
        if isinstance(v, ast.ListComp):
            posts.append(v.elt)
        elif not (isinstance(v, ast.List) and not v.elts):
            return None
    for m in mutations:
        ok = m.func.attr == "append" and len(m.args) == 1  # type: ignore[attr-defined]
        posts.append(m.args[0] if ok and _scope_of(tree, m.lineno) is scope else None)
    if not posts or any(not isinstance(p, ast.Call) or p not in calls for p in posts):
        return None
    at = {p.lineno for p in posts if p is not None}  # every one a call (checked above)
    op = called(calls, min(at)) if len(at) == 1 else None
    return None if op is None else (min(at), op)


def appended_last(tree: ast.Module, waits: list[ast.Call], calls: list[ast.Call], line: int
                  ) -> tuple[int, str] | None:
    """A wait on a list's handles (``for w in pending: w.wait()``, the list filled by
    ``pending.append(dist.all_reduce(x, async_op=True))``): the line and op of the last
    collective call appended to it before the loop, where every pass that reaches the wait
    runs that call last of all the collective calls before it (no branch or loop holds it that
    the wait is outside of; no other collective call between). Which handle the wait is on the
    source does not say; a rank whose one pending collective is its newest waits on this
    one. None where any append to the list is not a collective call. Appends in a function
    of their own (a gradient hook) run when it is called, not in the text's order: not read."""
    waited = _waited_list(tree, waits, line)
    if waited is None:
        return None
    listed, start, scope = waited
    appends = [n for n in ast.walk(scope) if isinstance(n, ast.Call)
               and isinstance(n.func, ast.Attribute) and n.func.attr == "append"
               and isinstance(n.func.value, ast.Name) and n.func.value.id == listed
               and n.lineno < start and _scope_of(tree, n.lineno) is scope]
    posts = [a.args[0] if len(a.args) == 1 and isinstance(a.args[0], ast.Call) else None
             for a in appends]
    if not appends or any(p is None or p not in calls for p in posts):
        return None
    last = max(appends, key=lambda n: n.lineno)
    held = any(isinstance(n, (ast.If, ast.For, ast.While, ast.AsyncFor, ast.Try))
               and n.lineno <= last.lineno <= (n.end_lineno or 0)
               and not n.lineno <= line <= (n.end_lineno or 0) for n in ast.walk(scope))
    between = any(last.lineno < c.lineno < line for c in calls)
    op = called(calls, last.lineno)
    return None if held or between or op is None else (last.lineno, op)


# the device modules whose synchronize() waits for everything the device was given
_DEVICES = frozenset({"cuda", "xpu", "mps", "npu", "hpu", "mtia", "accelerator"})
# a tensor read back to the host: it waits for the device's stream, where NCCL's collectives
# run; whether one is pending there the source cannot say
_READ_BACK = frozenset({"item", "cpu", "tolist"})


def wait_on_collective(tree: ast.Module, waits: list[ast.Call], calls: list[ast.Call],
                       line: int) -> bool | None:
    """Does the wait at ``line`` (one of WAIT_METHODS) wait on collectives posted earlier,
    as NCCL jobs wait? True: on a handle every assignment of which before it is a collective
    call (``work = dist.all_reduce(x, async_op=True)``, two exclusive branches that each
    post), or a device's ``torch.cuda.synchronize()``. False: on a handle the source shows
    assigned from something else (``done = threading.Event()``), or a stream's or an event's
    ``synchronize()``. None: the source does not say (``for work in pending:``, a handle
    passed in, a tensor's ``.item()``). The progress window takes only True (calling a
    healthy job's wait a stall is the worse error); the analysis, run once a stall is
    established, takes all but False."""
    what = waits_at(waits, line)
    if what is None:
        return None
    if what == "synchronize":
        return _device_synchronize(waits, line)
    if what in _READ_BACK:
        return None
    assigns, _scope = _handle_assigns(tree, waits, line)
    if not assigns:
        return True if _listed_from_one_call(tree, waits, calls, line) is not None else None
    if all(_collective_op(a, calls) is not None for a in assigns):
        return True
    # False only where the source shows what else it is; a helper's or a method's handle
    # (``h = reduce_async(x)``, ``pg.allreduce([x])``, ``.get_future()``) may well be one
    return False if any(_built_by(a.value) in _NOT_COLLECTIVE for a in assigns) else None


# what a handle waited on can be built by that is no collective's work
_NOT_COLLECTIVE = frozenset({"Event", "Condition", "Semaphore", "BoundedSemaphore", "Barrier",
                             "Thread", "Timer", "Queue", "SimpleQueue", "Lock", "RLock",
                             "Stream", "current_stream", "default_stream"})
_STREAM_WORDS = ("stream", "event")


def _built_by(node: ast.AST) -> str | None:
    """The name a call's value is built by (``threading.Event()``: ``Event``)."""
    return _name(node) if isinstance(node, ast.Call) else None


def _device_synchronize(waits: list[ast.Call], line: int) -> bool | None:
    """``torch.cuda.synchronize()`` (any device module's): True; a stream's or an event's
    (``torch.cuda.current_stream().synchronize()``, ``ev.synchronize()``), which waits for
    something else: False; an owner the source does not name (DeepSpeed's
    ``get_accelerator().synchronize()``, ``self.device_module.synchronize()``): None."""
    for call in waits:
        if call.lineno <= line <= (call.end_lineno or call.lineno) and \
                isinstance(call.func, ast.Attribute) and call.func.attr == "synchronize":
            owner = call.func.value
            name = owner.attr if isinstance(owner, ast.Attribute) else \
                owner.id if isinstance(owner, ast.Name) else _built_by(owner)
            if name in _DEVICES:
                return True
            if name is not None and (name in _NOT_COLLECTIVE or any(
                    w in name.lower() for w in _STREAM_WORDS)):
                return False
            return None
    return None
