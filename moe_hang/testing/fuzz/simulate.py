"""Where every rank of a generated job ends up, from what each one posts (gloo's semantics,
measured on torch 2.13 CPU): a collective is the k-th one a rank posts on a group; it
completes when every member posts its k-th with the same op and bytes, except a broadcast:
gloo's binomial tree (gloo/broadcast.cc; virtual rank 0 the root), in which a rank gets the
data from its parent, then leaves once every child posted its receive, whoever else has not
come; the same op with different bytes (and all_reduce against reduce_scatter) makes gloo
abort; different ops wait for ever; a send waits for its recv.

The answer is the ground truth's "which line": the marker each rank is stuck at, or the
collective gloo aborted in. Outcomes the model cannot predict (a framework's opaque backward
against something else, two different failures at once) say so, and the draw plants the fault
somewhere else."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from moe_hang.testing.fuzz.events import OPAQUE, P2P, Coll, Event, GroupKey, Stop

Members = Callable[[GroupKey, int], tuple[int, ...]]
State = Literal["finished", "hang", "abort", "unknown"]
# pairs of different ops that gloo aborts on (the rest wait for ever)
ABORTING_OPS = frozenset({frozenset({"all_reduce", "reduce_scatter"})})
Key = tuple[GroupKey, tuple[int, ...], int]  # (group, its members, sequence number)


@dataclass(frozen=True)
class Outcome:
    """``at``: the marker each unfinished rank is at (its event's, ``None`` for a rank that
    finished or exited/was killed); ``stopped``: how the ranks that stopped stopped;
    ``abort``: the markers of the members of the collective gloo aborted in; ``why``: for
    ``unknown``."""

    state: State
    at: dict[int, str | None] = field(default_factory=dict)
    stopped: dict[int, str] = field(default_factory=dict)
    abort: dict[int, str] = field(default_factory=dict)
    why: str = ""
    # a broadcast some members left while others are still in it (or never came): from
    # stacks alone, which member skipped it cannot be told (the recorder's seqs tell)
    partial: bool = False


def _tree(v: int, size: int) -> tuple[int | None, list[int]]:
    """Parent and children of virtual rank ``v`` in gloo's binomial broadcast of ``size``:
    in round i the ranks below 2**i send to their peer with bit i set."""
    dim = max(1, (size - 1).bit_length())
    high = v.bit_length() - 1  # the round v receives in (-1: the root)
    parent = v ^ (1 << high) if v else None
    children = [v | (1 << i) for i in range(high + 1, dim) if (v | (1 << i)) < size]
    return parent, children


class _Sim:
    def __init__(self, programs: Sequence[Sequence[Event]], members: Members) -> None:
        self.programs = programs
        self.members = members
        self.world = len(programs)
        self.pos = [0] * self.world
        self.seq: list[dict[GroupKey, int]] = [{} for _ in range(self.world)]
        self.stuck: set[int] = set()  # posted a collective that can never complete
        self.aborts: list[dict[int, str]] = []
        self.received: dict[Key, set[int]] = {}  # broadcast: the members that have the data
        self.passed: dict[Key, set[int]] = {}  # ... and those that left it
        self.unknown = ""

    def current(self, r: int) -> Event | None:
        prog = self.programs[r]
        return prog[self.pos[r]] if self.pos[r] < len(prog) else None

    def key(self, r: int) -> Key | None:
        ev = self.current(r)
        if not isinstance(ev, Coll):
            return None
        return ev.group, self.members(ev.group, r), self.seq[r].get(ev.group, 0)

    def advance(self, r: int) -> None:
        ev = self.current(r)
        if isinstance(ev, Coll):
            self.seq[r][ev.group] = self.seq[r].get(ev.group, 0) + 1
        self.pos[r] += 1

    def mismatch(self, colls: dict[int, Coll], stick: set[int] | None = None) -> None:
        """Different collectives at one seq: ``stick`` (default: all of them) can never
        complete theirs; gloo aborts on the same op with other bytes."""
        ops = {e.op for e in colls.values()}
        if OPAQUE in ops:
            self.unknown = (f"a framework's collectives against {sorted(ops - {OPAQUE})} "
                            f"at {sorted(e.marker for e in colls.values())}")
            return
        self.stuck.update(colls if stick is None else stick)
        if len(ops) == 1 or frozenset(ops) in ABORTING_OPS:
            self.aborts.append({m: e.marker for m, e in colls.items()})

    def step_collective(self, r: int) -> bool:
        ev, key = self.current(r), self.key(r)
        if r in self.stuck or not isinstance(ev, Coll) or key is None:
            return False
        group = key[1]
        here = {m: e for m in group if self.key(m) == key
                and isinstance(e := self.current(m), Coll)}
        if ev.op == "broadcast":
            return self.step_broadcast(r, ev, key, here)
        if len(here) < len(group):
            return False
        if len({(e.op, e.tag) for e in here.values()}) == 1:
            for m in group:
                self.advance(m)
            return True
        # the members in a broadcast go by its tree (step_broadcast), the others wait
        self.mismatch(here, {m for m, e in here.items() if e.op != "broadcast"})
        return False

    def step_broadcast(self, r: int, ev: Coll, key: Key, here: dict[int, Coll]) -> bool:
        group = key[1]
        v = group.index(r)
        got = self.received.setdefault(key, set())
        passed = self.passed.setdefault(key, set())
        odd = {m: e for m, e in here.items() if (e.op, e.tag) != (ev.op, ev.tag)}

        def posted(m: int) -> bool:
            return m in passed or (m in here and m not in odd)

        parent, children = _tree(v, len(group))
        if r not in got:
            if parent is not None and group[parent] in odd:
                self.mismatch({r: ev, group[parent]: odd[group[parent]]})
                return False
            if parent is None or (group[parent] in got and posted(group[parent])):
                got.add(r)
        if r not in got:
            return False
        kids = [group[c] for c in children]
        bad = {k: odd[k] for k in kids if k in odd}
        if bad:
            self.mismatch({r: ev, **bad})
            return False
        if all(posted(k) for k in kids):
            passed.add(r)
            self.advance(r)
            return True
        return False

    def step_p2p(self, r: int) -> bool:
        ev = self.current(r)
        if not (isinstance(ev, P2P) and ev.op == "send"):
            return False
        peer = self.current(ev.peer)
        if isinstance(peer, P2P) and peer.op == "recv" and peer.peer == r:
            if peer.tag != ev.tag:
                self.unknown = f"send {ev.tag} against recv {peer.tag}"
                return False
            self.advance(r)
            self.advance(ev.peer)
            return True
        return False

    def run(self) -> Outcome:
        moved = True
        while moved and not self.unknown:
            moved = False
            for r in range(self.world):
                moved |= self.step_collective(r)
                moved |= self.step_p2p(r)
        if self.unknown:
            return Outcome("unknown", why=self.unknown)
        stopped: dict[int, str] = {r: ev.how for r in range(self.world)
                                   if isinstance(ev := self.current(r), Stop)}
        at: dict[int, str | None] = {}
        for r in range(self.world):
            ev = self.current(r)
            gone = ev is None or (isinstance(ev, Stop) and ev.how in ("exit", "kill"))
            at[r] = None if gone or ev is None else ev.marker
        if self.aborts:
            hung = [r for r in self.stuck if not any(r in a for a in self.aborts)]
            if len(self.aborts) > 1 or hung:
                return Outcome("unknown", at, stopped,
                               why="more than one mismatch at once (which shows first is "
                                   "timing)")
            return Outcome("abort", at, stopped, self.aborts[0])
        if all(self.current(r) is None for r in range(self.world)):
            return Outcome("finished", at, stopped)
        partial = any(left and not set(key[1]) <= left for key, left in self.passed.items())
        return Outcome("hang", at, stopped, partial=partial)


def simulate(programs: Sequence[Sequence[Event]], members: Members) -> Outcome:
    """Step every rank's program until nothing can move."""
    return _Sim(programs, members).run()
