"""Where every rank of a generated job ends up, from what each one posts (gloo's semantics,
measured on torch 2.13 CPU; the rules are in :mod:`.gloo`): a collective is the k-th one a
rank posts on a group, whichever line or thread posted it; it completes when every member
posts its k-th with the same op and bytes, except a broadcast (gloo's tree: a rank leaves
once its parent sent and its children posted, whoever else has not come); the same op with
other bytes aborts, or lets the ranks with the fewest bytes through while the others wait
(gloo's ring all-reduce); different ops wait for ever; a send waits for its recv. A
collective posted with ``async_op=True`` does not block its thread (a later ``wait`` does),
and a background thread runs its own program until the main thread joins it.

The answer is the ground truth's "which line": the marker each rank is stuck at — for a rank
in ``work.wait()``, where its first unfinished collective was *posted*; for a rank joining a
thread, the thread's — or the collective gloo aborted in. Outcomes the model cannot predict
(two failures at once, gloo's worker threads all held) say so, and the draw plants the fault
somewhere else."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import moe_hang.testing.fuzz.gloo as gloo
from moe_hang.testing.fuzz.events import (
    OPAQUE,
    P2P,
    Coll,
    Event,
    Fork,
    GroupKey,
    Join,
    Stop,
    Wait,
)

Members = Callable[[GroupKey, int], tuple[int, ...]]
State = Literal["finished", "hang", "abort", "broken", "unknown"]
Key = tuple[GroupKey, tuple[int, ...], int]  # (group, its members, sequence number)
MAIN = "main"


@dataclass(frozen=True)
class Outcome:
    """``at``: the marker each unfinished rank is at (``None`` for a rank that finished or
    exited/was killed); ``stopped``: how the ranks that stopped stopped; ``abort``: the
    markers of the members of the collective gloo aborted in (``broken``: of the mismatch
    against a framework's opaque stretch, which aborts or hangs); ``why``: for ``unknown``."""

    state: State
    at: dict[int, str | None] = field(default_factory=dict)
    stopped: dict[int, str] = field(default_factory=dict)
    abort: dict[int, str] = field(default_factory=dict)
    why: str = ""
    # members some left while others are still in it (a broadcast's tree, gloo's ring letting
    # the smaller through): from stacks alone, which member skipped it cannot be told
    partial: bool = False
    # ranks whose line is a collective they posted earlier and now wait for (work.wait()),
    # with the marker their stack shows instead (the wait, or a later collective it blocks in)
    hidden: dict[int, str] = field(default_factory=dict)
    # abort: the members blocked in it that certainly end there, and those gloo may kill
    # (SIGABRT: their recorder is never written)
    sure: frozenset[int] = frozenset()
    killed: frozenset[int] = frozenset()
    # broken: the ranks inside the framework's stretch (they end there, whichever way)
    opaque: frozenset[int] = frozenset()
    # how many collectives each rank posted on each group
    posted: dict[int, dict[GroupKey, int]] = field(default_factory=dict)


@dataclass
class _Thread:
    prog: Sequence[Event]
    pos: int = 0
    blocked: Key | None = None  # a collective it posted and waits in
    pending: list[Key] = field(default_factory=list)  # posted with async_op, not yet waited

    def current(self) -> Event | None:
        return self.prog[self.pos] if self.pos < len(self.prog) else None


class _Sim:
    def __init__(self, programs: Sequence[Sequence[Event]], members: Members) -> None:
        self.members = members
        self.world = len(programs)
        self.threads: list[dict[str, _Thread]] = [{MAIN: _Thread(p)} for p in programs]
        self.seq: list[dict[GroupKey, int]] = [{} for _ in range(self.world)]
        self.posts: dict[Key, dict[int, Coll]] = {}
        self.left: dict[Key, set[int]] = {}  # the members that completed (left) it
        self.stuck: set[tuple[Key, int]] = set()  # can never complete it
        self.judged: set[Key] = set()
        self.aborts: list[tuple[Key, dict[int, str], gloo.Meeting]] = []
        self.broken: list[tuple[Key, dict[int, Coll]]] = []
        self.received: dict[Key, set[int]] = {}  # broadcast: the members that have the data
        self.unknown = ""

    # --- one thread ----------------------------------------------------------------------

    def done(self, key: Key, r: int) -> bool:
        return r in self.left.get(key, ())

    def post(self, r: int, ev: Coll) -> Key:
        seq = self.seq[r].get(ev.group, 0)
        self.seq[r][ev.group] = seq + 1
        key = (ev.group, self.members(ev.group, r), seq)
        self.posts.setdefault(key, {})[r] = ev
        return key

    def step_thread(self, r: int, t: _Thread) -> bool:
        ev = t.current()
        if isinstance(ev, Coll):
            if t.blocked is None:
                key = self.post(r, ev)
                if ev.nowait:
                    t.pending.append(key)
                    t.pos += 1
                else:
                    t.blocked = key
                return True
            if self.done(t.blocked, r):
                t.blocked = None
                t.pos += 1
                return True
            return False
        if isinstance(ev, Wait):
            if all(self.done(k, r) for k in t.pending):
                t.pending = []
                t.pos += 1
                return True
            return False
        if isinstance(ev, Fork):
            self.threads[r][ev.thread] = _Thread(ev.events)
            t.pos += 1
            return True
        if isinstance(ev, Join):
            other = self.threads[r].get(ev.thread)
            if other is None or other.current() is None:
                t.pos += 1
                return True
            return False
        if isinstance(ev, P2P):
            return self.step_p2p(r, t, ev)
        return False  # finished, or stopped

    def step_p2p(self, r: int, t: _Thread, ev: P2P) -> bool:
        if ev.op != "send":
            return False
        peer = self.threads[ev.peer][MAIN]
        pe = peer.current()
        if isinstance(pe, P2P) and pe.op == "recv" and pe.peer == r:
            if pe.tag != ev.tag:
                self.unknown = f"send {ev.tag} against recv {pe.tag}"
                return False
            t.pos += 1
            peer.pos += 1
            return True
        return False

    # --- one collective ---------------------------------------------------------------------

    def here(self, key: Key) -> dict[int, Coll]:
        """The members that posted ``key`` and are still in it."""
        left = self.left.get(key, set())
        return {m: e for m, e in self.posts[key].items() if m not in left}

    def settle(self, key: Key) -> bool:
        group = key[1]
        posts = self.posts[key]
        if any(e.op == "broadcast" for e in posts.values()):
            moved = False
            for r in group:
                here = self.here(key)
                e = here.get(r)
                if e is None or (key, r) in self.stuck:
                    continue
                if e.op == "broadcast":
                    moved |= self.step_broadcast(r, e, key, here)
                elif len(here) == len(group) and key not in self.judged:
                    # the members in a broadcast go by its tree, the others wait
                    self.judged.add(key)
                    self.mismatch(key, here, {m for m, x in here.items() if x.op != "broadcast"})
            return moved
        if key in self.judged or len(posts) < len(group):
            return False
        self.judged.add(key)
        if len({(e.op, e.tag) for e in posts.values()}) == 1:
            self.left.setdefault(key, set()).update(group)
            return True
        return self.mismatch(key, dict(posts))

    def mismatch(self, key: Key, colls: dict[int, Coll], stick: set[int] | None = None) -> bool:
        """Different collectives at one seq: ``stick`` (default: all of them) cannot complete
        theirs, unless gloo lets some through (returns whether it did)."""
        ops = {e.op for e in colls.values()}
        stick = set(colls) if stick is None else stick
        if OPAQUE in ops:
            self.broken.append((key, colls))
            self.stuck.update((key, m) for m in colls)
            return False
        op = next(iter(ops))
        if len(ops) == 1 and op != "broadcast" and len(colls) == len(key[1]):
            meet = gloo.same_op(op, {m: e.tag for m, e in colls.items()}, key[1])
            if not meet.abort:
                self.left.setdefault(key, set()).update(meet.through)
                self.stuck.update((key, m) for m in stick - meet.through)
                return bool(meet.through)
            self.stuck.update((key, m) for m in stick)
            self.aborts.append((key, {m: e.marker for m, e in colls.items()}, meet))
            return False
        self.stuck.update((key, m) for m in stick)
        if len(ops) == 1 or frozenset(ops) in gloo.ABORTING_OPS:
            self.aborts.append((key, {m: e.marker for m, e in colls.items()},
                                gloo.Meeting(True, killed=frozenset(colls))))
        return False

    def step_broadcast(self, r: int, ev: Coll, key: Key, here: dict[int, Coll]) -> bool:
        group = key[1]
        got = self.received.setdefault(key, set())
        passed = self.left.setdefault(key, set())
        odd = {m: e for m, e in here.items() if (e.op, e.tag) != (ev.op, ev.tag)}

        def posted(m: int) -> bool:
            return m in passed or (m in here and m not in odd)

        parent, children = gloo.tree(group.index(r), len(group))
        moved = False
        if r not in got:
            if parent is not None and group[parent] in odd:
                self.mismatch(key, {r: ev, group[parent]: odd[group[parent]]})
                return False
            if parent is None or (group[parent] in got and posted(group[parent])):
                got.add(r)
                moved = True
        if r not in got:
            return False
        kids = [group[c] for c in children]
        bad = {k: odd[k] for k in kids if k in odd}
        if bad:
            self.mismatch(key, {r: ev, **bad})
            return moved
        if all(posted(k) for k in kids):
            passed.add(r)
            return True
        return moved

    # --- the whole run ------------------------------------------------------------------------

    def run(self) -> Outcome:
        moved = True
        while moved and not self.unknown:
            moved = False
            for r in range(self.world):
                for t in list(self.threads[r].values()):
                    while self.step_thread(r, t):
                        moved = True
            for key in list(self.posts):
                moved |= self.settle(key)
        if self.unknown:
            return Outcome("unknown", why=self.unknown)
        return self.outcome()

    def line(self, r: int, t: _Thread) -> tuple[str | None, str | None]:
        """Where thread ``t`` of rank ``r`` is: the oldest collective it posted that never
        completes (as a recorder reads a rank: an async one stuck before the one it blocks
        in, or the one its ``work.wait()`` waits for), else what it blocks in; and, where
        that is not what its stack shows, the marker its stack shows (the wait, the later
        collective)."""
        ev = t.current()
        if isinstance(ev, Stop):
            return (None if ev.how in ("exit", "kill") else ev.marker), None
        first = next((k for k in t.pending if not self.done(k, r)), None)
        if isinstance(ev, (Coll, P2P, Wait)) and first is not None:
            return self.posts[first][r].marker, ev.marker
        if isinstance(ev, (Coll, P2P, Wait)):
            return ev.marker, ev.marker if isinstance(ev, Wait) else None
        if isinstance(ev, Join) and ev.thread in self.threads[r]:
            return self.line(r, self.threads[r][ev.thread])
        return None, None

    def workers_held(self) -> str:
        """A collective gloo would never run: posted after two of its group's on that rank
        were stuck for good (both worker threads held), yet completed in the model."""
        for r in range(self.world):
            mine = sorted(k for k in self.posts if r in self.posts[k])
            for group in {k[0] for k in mine}:
                keys = [k for k in mine if k[0] == group]
                held = [k for k in keys if not self.done(k, r)]
                if len(held) >= gloo.WORKERS and any(
                        self.done(k, r) and k[2] > held[gloo.WORKERS - 1][2] for k in keys):
                    return f"rank {r}: gloo's worker threads of group {group} are all held"
        return ""

    def outcome(self) -> Outcome:
        stopped: dict[int, str] = {
            r: ev.how for r in range(self.world)
            if isinstance(ev := self.threads[r][MAIN].current(), Stop)}
        at: dict[int, str | None] = {}
        hidden: dict[int, str] = {}
        for r in range(self.world):
            at[r], shown = self.line(r, self.threads[r][MAIN])
            if shown is not None:
                hidden[r] = shown
        posted = {r: dict(self.seq[r]) for r in range(self.world)}
        if why := self.workers_held():
            return Outcome("unknown", at, stopped, why=why)
        blocked = {(t.blocked, r) for r in range(self.world)
                   for t in self.threads[r].values() if t.blocked is not None}
        if self.aborts:
            key, markers, meet = self.aborts[0]
            hung = [p for p in self.stuck if not (p[0] == key and p[1] in markers)]
            if len(self.aborts) > 1 or hung or self.broken:
                return Outcome("unknown", at, stopped,
                               why="more than one mismatch at once (which shows first is "
                                   "timing)")
            return Outcome("abort", at, stopped, markers, hidden=hidden,
                           sure=frozenset(m for m in meet.sure if (key, m) in blocked),
                           killed=meet.killed, posted=posted)
        if self.broken:
            key, colls = self.broken[0]
            if len(self.broken) > 1 or any(p[0] != key for p in self.stuck):
                return Outcome("unknown", at, stopped, why="more than one mismatch at once")
            return Outcome("broken", at, stopped, {m: e.marker for m, e in colls.items()},
                           opaque=frozenset(m for m, e in colls.items() if e.op == OPAQUE),
                           posted=posted)
        if all(self.threads[r][MAIN].current() is None for r in range(self.world)):
            if self.stuck:  # posted with async_op, never waited: what teardown does with it
                return Outcome("unknown", at, stopped, why="a collective never waited for")
            return Outcome("finished", at, stopped, posted=posted)
        partial = any(left and not set(key[1]) <= left for key, left in self.left.items())
        return Outcome("hang", at, stopped, partial=partial, hidden=hidden,
                       posted=posted)


def simulate(programs: Sequence[Sequence[Event]], members: Members) -> Outcome:
    """Step every rank's program until nothing can move."""
    return _Sim(programs, members).run()
