"""What the job's source says about the lines of a capture, as it was read when the capture
was made (``source.json`` in the run directory; docs/DESIGN.md §8) — pure records.

The analysis never opens a source file: it asks these records, so a capture gives the same
verdict on any machine, and one without them (torch's own dumps, an older capture) decides
only what its collectives can. For each user line on a stack or in a recorder frame:

- its *statement path*: the statements that hold it, outermost first, each as the block it
  sits in (the statement owning that block and which of its fields: ``body``, ``orelse``,
  ``handlers0`` ...), its index there, and what kind of statement it is (a loop's header
  text too). Two lines of one file are ordered, exclusive or nested by comparing paths;
- the rank condition it runs under (``if rank == 0``, ``if not (rank in bad)``), if any;
- whether the collective called on it runs on the default group (no ``group=``);
- the *gates* on the way to it in its function: the ``if`` statements it sits in, and the
  guards before it that leave early (``if remote == 0: return``): a rank whose data decides
  otherwise at one never reaches the line.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

SCHEMA = "moe-hang/source/v1"

# how a job names its own rank: a condition on one of these is a condition on the rank
RANK_WORDS = re.compile(
    r"\b(\w*rank\w*|RANK|is_main\w*|is_master\w*|is_global_zero|is_local_main\w*|"
    r"main_process\w*|process_index|local_process_index)\b")


@dataclass(frozen=True)
class Step:
    """One statement on a line's path: ``block`` names the block it sits in (the owning
    statement's ``line:col:field``, ``module`` at the top), ``index`` its place there."""

    block: str
    index: int
    field: str  # which field of the owning statement holds the block: body, orelse, ...
    kind: str  # the statement's AST class: If, For, While, With, Try, Expr, ...
    line: int  # where the statement starts
    header: str | None = None  # a loop's header (``for expert in self.experts``)
    # a loop's or a function's: the lines in its body that call a collective of
    # torch.distributed by name (what the source shows; calls through other code are not)
    calls: tuple[int, ...] = ()
    end: int = 0  # where the statement ends
    # a loop's: the lines of the statements in its body that leave it before its end (its
    # own ``break``, a ``return``), not those of a loop or a function nested in it
    exits: tuple[int, ...] = ()
    # a loop's or a function's: the lines in its body that call a point-to-point op of
    # torch.distributed by name, with the op (``send`` or ``recv``; ``isend`` posts a send):
    # where a rank's peer passes the op that answers the one the rank waits in
    p2p: tuple[tuple[int, str], ...] = ()
    # a loop's: the calls in its body of a function of the module that posts collectives
    # (a rank-only evaluation or checkpoint): the call's line, the line in the function that
    # posts, the function's name, the op posted there, and how: ``fsdp`` (FSDP2's
    # all-gathers: ``unshard()``, a call of a module passed to ``fully_shard``), else the
    # torch.distributed function called
    helpers: tuple[tuple[int, int, str, str, str], ...] = ()

    def to_list(self) -> list[Any]:
        return [self.block, self.index, self.field, self.kind, self.line, self.header,
                list(self.calls), self.end, list(self.exits), [list(p) for p in self.p2p],
                [list(h) for h in self.helpers]]

    @classmethod
    def from_list(cls, d: Any) -> Step | None:
        try:
            block, index, fld, kind, line, header, *more = d
            calls = tuple(int(x) for x in more[0]) if more else ()
            end = int(more[1]) if len(more) > 1 else int(line)
            exits = tuple(int(x) for x in more[2]) if len(more) > 2 else ()
            p2p = tuple((int(n), str(op)) for n, op in more[3]) if len(more) > 3 else ()
            helpers = tuple((int(c), int(p), str(f), str(op), str(how))
                            for c, p, f, op, how in more[4]) if len(more) > 4 else ()
            return cls(str(block), int(index), str(fld), str(kind), int(line),
                       None if header is None else str(header), calls, end, exits, p2p,
                       helpers)
        except (TypeError, ValueError):
            return None


@dataclass(frozen=True)
class Gate:
    """``if TEST:`` at ``line`` (ending at ``end``) on the way to a line: ``how`` is ``if``
    (the line is in its body: reached only where TEST holds), ``else`` (in its ``else``), or
    how a guard before the line leaves early where TEST holds (``return``, ``continue``,
    ``break``, ``raise``: the line is not reached in that call of the function, that lap of
    the loop)."""

    line: int
    end: int
    test: str
    how: str

    def to_list(self) -> list[Any]:
        return [self.line, self.end, self.test, self.how]

    @classmethod
    def from_list(cls, d: Any) -> Gate | None:
        try:
            line, end, test, how = d
            return cls(int(line), int(end), str(test), str(how))
        except (TypeError, ValueError):
            return None


# what a thread calls from its own line to wait on a collective posted earlier: NCCL jobs
# wait this way (Work.wait, a Future's, a stream's synchronize, a tensor copied to the host)
WAIT_METHODS = frozenset({"wait", "synchronize", "item", "cpu", "tolist", "result", "value"})


@dataclass(frozen=True)
class LineFacts:
    path: tuple[Step, ...]
    rank_condition: str | None = None  # ``if rank == 0`` / ``if not (rank == 0)``
    default_group: bool | None = None  # the collective called here runs on every rank
    # a method called here that waits on work posted earlier (``work.wait()``: "wait"), as
    # NCCL jobs wait on their collectives: one of WAIT_METHODS
    waits: str | None = None
    # a wait's: the line and the op of the collective call whose result it waits on
    # (``work = dist.all_reduce(g, async_op=True)`` ... ``work.wait()``), where the source
    # shows one assignment of that name from a collective before the wait
    posted: tuple[int, str] | None = None
    # the group it passes, where that is a name the module assigns once, at its top level
    # (``LOG = dist.new_group(...)``): every line that passes it posts on the same group
    group: str | None = None
    # it runs on a group of every rank: the default group, or ``group=LOG`` where the
    # module binds LOG once to ``new_group()`` of every rank (None: the source does not say)
    every_rank: bool | None = None
    # the gates on the way to it, in its function (or its module's top level), nearest first
    gates: tuple[Gate, ...] = ()
    # a wait's: does it wait on collectives posted earlier — True (on a collective's handle,
    # a device's synchronize), False (on something the source shows is not one: an Event, a
    # stream), None (the source does not say: a handle from a list, a tensor's ``.item()``)
    wait_on: bool | None = None
    # the line of the ``if`` (or of the guard) ``rank_condition`` is
    rank_condition_line: int | None = None
    # a wait on a list's handles (``for w in pending: w.wait()``): the line and op of the last
    # collective call appended to the list before it on every pass (which handle is waited on
    # the source does not say: the rank's newest, where that is the one pending)
    appended_last: tuple[int, str] | None = None
    # the collective called here, by its function's name (``all_reduce``), where one is
    call: str | None = None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"path": [s.to_list() for s in self.path]}
        if self.rank_condition is not None:
            d["rank_condition"] = self.rank_condition
        if self.default_group is not None:
            d["default_group"] = self.default_group
        if self.waits is not None:
            d["waits"] = self.waits
        if self.posted is not None:
            d["posted"] = list(self.posted)
        if self.group is not None:
            d["group"] = self.group
        if self.every_rank is not None:
            d["every_rank"] = self.every_rank
        if self.gates:
            d["gates"] = [g.to_list() for g in self.gates]
        if self.wait_on is not None:
            d["wait_on"] = self.wait_on
        if self.rank_condition_line is not None:
            d["rank_condition_line"] = self.rank_condition_line
        if self.appended_last is not None:
            d["appended_last"] = list(self.appended_last)
        if self.call is not None:
            d["call"] = self.call
        return d

    @classmethod
    def from_dict(cls, d: Any) -> LineFacts | None:
        if not isinstance(d, dict) or not isinstance(d.get("path"), list):
            return None
        steps = [s for s in (Step.from_list(x) for x in d["path"]) if s is not None]
        cond = d.get("rank_condition")
        dg = d.get("default_group")
        waits = d.get("waits")
        posted, last = _line_op(d.get("posted")), _line_op(d.get("appended_last"))
        group = d.get("group")
        every = d.get("every_rank")
        raw_gates = d.get("gates")
        gates = tuple(g for g in (Gate.from_list(x) for x in raw_gates) if g is not None) \
            if isinstance(raw_gates, list) else ()
        return cls(tuple(steps), str(cond) if cond is not None else None,
                   dg if isinstance(dg, bool) else None,
                   waits if waits in WAIT_METHODS else None, posted,
                   group if isinstance(group, str) and group else None,
                   every if isinstance(every, bool) else None, gates,
                   wait_on if isinstance(wait_on := d.get("wait_on"), bool) else None,
                   cl if isinstance(cl := d.get("rank_condition_line"), int)
                   and not isinstance(cl, bool) else None, last,
                   call if isinstance(call := d.get("call"), str) and call else None)


def _line_op(raw: Any) -> tuple[int, str] | None:
    return (raw[0], raw[1]) if isinstance(raw, list) and len(raw) == 2 \
        and isinstance(raw[0], int) and isinstance(raw[1], str) else None


@dataclass
class SourceFacts:
    """Per file (absolute path as the frames name it), per line: what the source said. A
    file that could not be read is absent: nothing is known of its lines."""

    files: dict[str, dict[int, LineFacts]] = field(default_factory=dict)

    def line(self, file: str, line: int) -> LineFacts | None:
        return self.files.get(file, {}).get(line)

    def knows(self, file: str) -> bool:
        return file in self.files

    def merge(self, other: SourceFacts) -> None:
        for f, lines in other.files.items():
            self.files.setdefault(f, {}).update(lines)

    def to_dict(self) -> dict[str, Any]:
        return {"schema": SCHEMA,
                "files": {f: {str(n): lf.to_dict() for n, lf in sorted(lines.items())}
                          for f, lines in sorted(self.files.items())}}

    @classmethod
    def from_dict(cls, d: Any) -> SourceFacts:
        """Tolerant: anything malformed is left out (nothing known of it)."""
        out = cls()
        files = d.get("files") if isinstance(d, dict) else None
        if not isinstance(files, dict):
            return out
        for f, lines in files.items():
            if not isinstance(lines, dict):
                continue
            got: dict[int, LineFacts] = {}
            for n, lf in lines.items():
                facts = LineFacts.from_dict(lf)
                if facts is not None and str(n).isdigit():
                    got[int(n)] = facts
            out.files[str(f)] = got
        return out
