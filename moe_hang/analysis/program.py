"""The program every rank agreed on, learned from the steps they agreed on (docs/DESIGN.md
§8.3) — pure.

Up to a group's first divergence every member posted the same collectives under the same
sequence numbers: that stretch is the job's own program, as it ran. From it: which collective
follows which (a training loop repeats: what came after X before comes after X again), which
collectives are a regular part of it, and what shape each always had. A rank whose next
collective is not what always followed its last one, while the others' is, deviated.

A collective is known at two grains: *fine* — its op, its group's kind and the user call path
that posted it (every user frame, outermost first: an evaluation's forward is another path
than training's, though FSDP posts both from the same module line); *coarse* — its op, its
group's kind, its sizes and dtypes (where no frames were recorded). A question is answered at
the finest grain both collectives have.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from itertools import pairwise

from moe_hang.analysis.timeline import RankViews, group_kind
from moe_hang.evidence.flight_recorder import Collective
from moe_hang.evidence.ops import SAME_SIZE_OPS
from moe_hang.evidence.stacks import is_library_frame

Key = tuple[object, ...]


UserPath = tuple[tuple[str, int], ...]


def user_path(c: Collective, memo: dict[int, UserPath] | None = None) -> UserPath:
    """The user frames that posted ``c``, outermost first (the probe's step name where the
    collective came from its posting log). ``memo``: paths by frame list, for a caller that
    holds every collective it asks about (the loader shares one list between the entries
    posted from one stack: a few dozen distinct lists under thousands of entries)."""
    if c.source == "probe" and c.name:
        return (("probe", hash(c.name)),)
    if not c.frames:
        return ()
    if memo is not None:
        hit = memo.get(id(c.frames))
        if hit is None:
            hit = memo[id(c.frames)] = user_path(c)
        return hit
    return tuple((f.file, f.line) for f in reversed(c.frames) if not is_library_frame(f))


def fine_key(c: Collective, memo: dict[int, UserPath] | None = None) -> Key | None:
    path = user_path(c, memo)
    if c.tag:
        return (c.op, group_kind(c), "tag", c.tag)
    return (c.op, group_kind(c), path) if path else None


def _warmed_up(keys: list[Key], p: int) -> bool:
    """A warm-up longer than a period, then a step of ``p`` repeated: the stretch that
    repeats with ``p`` holds at least three steps (every position seen again twice), is
    longer than what came before it (DDP's first steps post its broadcasts and the bucket
    rebuild: two steps of three collectives), and repeats with no shorter period (four
    equal collectives at the end of one step are no step of two). What came before holds
    no whole pass of the step (a warm-up is not a step): a loop whose count changes from
    step to step (micro-batches, experts that got tokens) repeats one collective, or one
    pair, for a while — that is no step, and neither is one collective repeated."""
    n = len(keys)
    if p < 2:
        return False
    start = n - p
    while start > 0 and keys[start - 1] == keys[start - 1 + p]:
        start -= 1
    stretch = keys[start:]
    if len(stretch) < 3 * p or len(stretch) <= start:
        return False
    step = stretch[:p]
    if any(keys[i:i + p] == step[k:] + step[:k] for k in range(p) for i in range(start)):
        return False
    return not any(p % q == 0 and all(stretch[i] == stretch[i + q]
                                      for i in range(len(stretch) - q))
                   for q in range(1, p))


def signature(c: Collective) -> Key:
    """What must be equal for two ranks' entries of one collective to pair: op, sizes (where
    every member holds the same), dtypes."""
    # map, not a generator: called for every collective of every rank (8192 ranks' dumps)
    sizes = tuple(map(tuple, c.input_sizes)) if c.op in SAME_SIZE_OPS else ()
    return (c.op, sizes, tuple(c.dtypes))


P2P_OPS = frozenset({"send", "recv", "isend", "irecv"})


def coarse_key(c: Collective) -> Key:
    return (group_kind(c), *signature(c))


Keys = tuple[Key | None, Key, Key]  # fine_key, coarse_key, signature


def keys_of(c: Collective, memo: dict[int, UserPath] | None = None) -> Keys:
    sig = signature(c)
    return fine_key(c, memo), (group_kind(c), *sig), sig


@dataclass
class Program:
    """What the agreed steps showed (see the module doc)."""

    follows_fine: dict[Key, set[Key]] = field(default_factory=dict)
    follows_coarse: dict[Key, set[Key]] = field(default_factory=dict)
    # across groups, in each rank's posting order (one group's next is the next seq)
    across_fine: dict[Key, set[Key]] = field(default_factory=dict)
    across_coarse: dict[Key, set[Key]] = field(default_factory=dict)
    # how often each key was seen followed by anything (per map): "never followed by x" is
    # evidence only for a key seen followed more than once (once is one step: the boundary
    # of the first step, a phase seen for the first time, say nothing)
    seen_after: dict[tuple[str, Key], int] = field(default_factory=dict)
    # per group: the agreed run (one member's, the longest) and its period where the last
    # two periods repeat exactly — a training step: what comes at each seq is then known
    runs: dict[str, list[Collective]] = field(default_factory=dict)
    periods: dict[str, int] = field(default_factory=dict)
    run_paths: dict[str, int] = field(default_factory=dict)  # of runs[pg], how many have paths
    seen_fine: set[Key] = field(default_factory=set)
    seen_coarse: set[Key] = field(default_factory=set)
    # per fine key (else per op and group kind): every signature it was posted with
    shapes: dict[Key, set[Key]] = field(default_factory=dict)
    # the kinds of group whose agreed run repeats a collective: a whole step was seen, so
    # what it never posted is not part of it (before that, "never seen" says nothing)
    repeats: set[str] = field(default_factory=set)
    # what each run learned before added to the counts (see learn)
    _learned: dict[Key, list[tuple[str, Key]]] = field(default_factory=dict, repr=False)

    def learn(self, run: list[Collective], keys: list[Keys] | None = None,
              ids: tuple[int, ...] | None = None) -> None:
        """One member's agreed collectives of one group, in sequence order (consecutive);
        ``keys``: each one's :func:`keys_of`; ``ids``: a number per distinct keys."""
        ks = keys if keys is not None else [keys_of(c) for c in run]
        # a consecutive run learns a function of its keys alone: the members of a group (and
        # of its kind) mostly posted the same; a run learned before only counts again
        fp = ("within", ids if ids is not None else tuple(ks)) \
            if run and run[-1].seq - run[0].seq == len(run) - 1 else None
        if self._replayed(fp):
            return
        if run and len({k[0] or k[1] for k in ks}) < len(ks):
            self.repeats.add(group_kind(run[0]))
        for fk, ck, sig in ks:
            if fk is not None:
                self.seen_fine.add(fk)
                self.shapes.setdefault(fk, set()).add(sig)
            self.seen_coarse.add(ck)
            self.shapes.setdefault((sig[0], ck[0]), set()).add(sig)  # (op, group kind)
        counted: list[tuple[str, Key]] = []
        for i in (i for i in range(1, len(run)) if run[i].seq == run[i - 1].seq + 1):
            counted += self._add(self.follows_fine, self.follows_coarse, "within", ks[i - 1], ks[i])
        if fp is not None:
            self._learned[fp] = counted

    def _replayed(self, fp: Key | None) -> bool:
        """Learned before: count its steps again (what follows what is already known)."""
        counted = self._learned.get(fp) if fp is not None else None
        if counted is None:
            return False
        for k in counted:
            self.seen_after[k] += 1
        return True

    def learn_period(self, run: list[Collective], keys: list[Keys] | None = None) -> None:
        """Keep the longest consecutive agreed run of a group, and the smallest period its
        last two periods repeat with. ``keys``: as for :meth:`learn`."""
        if not run:
            return
        pg = run[0].pg
        tail = [run[-1]]
        for c in reversed(run[:-1]):  # the consecutive stretch that ends the run
            if c.seq != tail[-1].seq - 1:
                break
            tail.append(c)
        tail.reverse()
        # the longest; of two as long (one agreed run, every member's), the one whose
        # recorder kept the most paths: the same run, read closer
        kept = len(self.runs.get(pg, ()))
        if len(tail) < kept:
            return
        ks = keys[len(run) - len(tail):] if keys is not None else [keys_of(c) for c in tail]
        paths = sum(bool(k[0]) for k in ks)
        if (len(tail), paths) <= (kept, self.run_paths.get(pg, 0)):
            return
        self.runs[pg] = tail
        self.run_paths[pg] = paths
        same = [k[0] or k[1] for k in ks]  # same_key, from the keys at hand
        n = len(same)
        for p in range(1, n // 2 + 1):
            # every period but the first (a warm-up) repeats the next exactly
            start = n - max(2, n // p - 1) * p
            if all(same[i] == same[i + p] for i in range(max(0, start), n - p)) \
                    or _warmed_up(same, p):
                self.periods[pg] = p
                return
        self.periods.pop(pg, None)

    def tentative(self, c: Collective | None) -> Collective | None:
        """Weaker than :meth:`expected`: what ``c``'s seq holds where the agreed run is not
        yet two steps long, by the smallest period the whole run is consistent with (at
        least two collectives seen again a period on) — one step and the start of the next,
        as a job gives when it hangs in its second epoch."""
        if c is None or c.pg not in self.runs:
            return None
        run = self.runs[c.pg]
        j = c.seq - run[-1].seq
        if j < 1:
            return None
        keys = [same_key(x) for x in run]
        n = len(keys)
        for p in range(1, n - 1):
            if all(keys[i] == keys[i + p] for i in range(n - p)):
                return run[n - p + (j - 1) % p]
        return None

    def expected(self, c: Collective | None) -> Collective | None:
        """What the program posts on ``c``'s group at ``c``'s seq, a period on from the
        agreed run (None: the run has no period, or ``c`` is not past it)."""
        if c is None or c.pg not in self.periods:
            return None
        run, p = self.runs[c.pg], self.periods[c.pg]
        j = c.seq - run[-1].seq
        if j < 1:
            return None
        return run[len(run) - p + (j - 1) % p]

    def skipped_to(self, mine: Collective, theirs: Collective) -> int | None:
        """Where ``theirs`` is what the program posts at its seq: how many of the program's
        collectives after it ``mine`` (posted at that seq) is — the number a rank posting
        it there skipped (within one step); None where it is none of them."""
        exp = self.expected(theirs)
        if exp is None:
            # no whole step seen twice: what followed what says as much — the others' was
            # followed by the culprit's, never the other way round (a run of experts, then
            # the head)
            return 1 if self.follows(theirs, mine) is True \
                and self.follows(mine, theirs) is not True else None
        if not same(theirs, exp):
            return None
        for k in range(1, self.periods[theirs.pg]):
            nxt = self.expected(replace(theirs, seq=theirs.seq + k))
            if nxt is not None and same(mine, nxt):
                return k
        return None

    def learn_order(self, order: list[Collective], keys: list[Keys] | None = None,
                    ids: tuple[int, ...] | None = None) -> None:
        """One rank's agreed collectives of every group, in the order it posted them: what
        follows what across groups (the step's all-gathers, then its all-reduce on another
        group). ``keys``, ``ids``: as for :meth:`learn`."""
        ks = keys if keys is not None else [keys_of(c) for c in order]
        fp = ("across", ids if ids is not None else tuple(ks))
        if self._replayed(fp):
            return
        counted: list[tuple[str, Key]] = []
        for a, b in pairwise(ks):
            counted += self._add(self.across_fine, self.across_coarse, "across", a, b)
        self._learned[fp] = counted

    def _add(self, fine: dict[Key, set[Key]], coarse: dict[Key, set[Key]], where: str,
             a: Keys, b: Keys) -> list[tuple[str, Key]]:
        """``b`` followed ``a``; the counts it added to (see :attr:`seen_after`)."""
        counted: list[tuple[str, Key]] = []
        fa, fb = a[0], b[0]
        if fa is not None and fb is not None:
            fine.setdefault(fa, set()).add(fb)
            counted.append((where, fa))
        coarse.setdefault(a[1], set()).add(b[1])
        counted.append((where, a[1]))
        for k in counted:
            self.seen_after[k] = self.seen_after.get(k, 0) + 1
        return counted

    def follows(self, prev: Collective | None, nxt: Collective | None,
                posted: bool = False) -> bool | None:
        """Did ``nxt`` come right after ``prev`` in the agreed steps — on its group (the next
        seq), or, ``posted``, in the order a rank posted them whatever the group? None:
        nothing learned after ``prev`` (no history there, or it never was a regular step)."""
        if prev is None or nxt is None:
            return None
        if prev.op in P2P_OPS or nxt.op in P2P_OPS:
            return None  # the program is learned from collectives: it never saw a send/recv
        within = prev.pg == nxt.pg and not posted
        where = "within" if within else "across"
        fine = self.follows_fine if within else self.across_fine
        coarse = self.follows_coarse if within else self.across_coarse
        fp, fn = fine_key(prev), fine_key(nxt)
        if fp is not None and fn is not None and fp in fine:
            if fn in fine[fp]:
                return True
            if self.seen_after.get((where, fp), 0) > 1:
                return False
            # its path seen followed once (the ranks whose recorder kept frames): their
            # shapes may have been seen more often, by every rank
        cp = coarse_key(prev)
        if cp in coarse:
            return True if coarse_key(nxt) in coarse[cp] else (
                False if self.seen_after.get((where, cp), 0) > 1 else None)
        return None

    def endless(self, c: Collective | None) -> bool:
        """``c`` was posted several times running in the agreed steps and nothing else ever
        followed it: the run never ended there, so where it ends (one more of it, or one
        fewer) is nothing they showed."""
        if c is None:
            return False
        fk, ck = fine_key(c), coarse_key(c)
        # on its group, and in the order each rank posted (another group's next ends it too)
        for fine, coarse in ((self.follows_fine, self.follows_coarse),
                             (self.across_fine, self.across_coarse)):
            if fk is not None and fk in fine:
                if fine[fk] != {fk}:
                    return False
            elif coarse.get(ck, {ck}) != {ck}:
                return False
        return self.follows_coarse.get(ck) == {ck}

    def regular(self, c: Collective) -> bool | None:
        """Was ``c`` posted in the agreed steps (by its path, else its shape)? None: nothing
        learned on its kind of group."""
        if group_kind(c) not in self.repeats:
            return None
        fk = fine_key(c)
        if fk is not None and any(k[1] == fk[1] for k in self.seen_fine):
            return fk in self.seen_fine
        return coarse_key(c) in self.seen_coarse

    def keeps_shape(self, c: Collective) -> bool | None:
        """Does ``c`` have the one signature its collective (its path, else its op on this
        kind of group) had in every agreed step? None: no history, or it varied (ragged
        sizes: history cannot tell)."""
        fk = fine_key(c)
        seen = self.shapes.get(fk) if fk is not None else None
        if seen is None:
            seen = self.shapes.get((c.op, group_kind(c)))
        if not seen or len(seen) != 1:
            return None
        return signature(c) in seen


def same_key(c: Collective) -> Key:
    """What a collective is for the program: its path where recorded, else its shape."""
    return fine_key(c) or coarse_key(c)


def same(a: Collective, b: Collective) -> bool:
    """The same collective of the program: by path where both have one, else by shape."""
    fa, fb = fine_key(a), fine_key(b)
    return fa == fb if fa is not None and fb is not None else coarse_key(a) == coarse_key(b)


def agreed_runs(views: RankViews, bounds: dict[str, int | None]) -> Iterable[list[Collective]]:
    """Each member's collectives of each group below that group's first divergence (``bounds``:
    its seq; None: the group never diverged), completed or not pending, in sequence order."""
    for v in views.values():
        for pg, by_seq in v.tl.by_pg.items():
            bound = bounds.get(pg)
            run = [c for s, c in sorted(by_seq.items())
                   if (bound is None or s < bound) and c.completed is not False]
            if run:
                yield run


def learn(views: RankViews, bounds: dict[str, int | None]) -> Program:
    p = Program()
    # each distinct collective keyed once, by what keys_of reads (lists by identity: the
    # loader shares them, all alive during this call), and numbered: a run learned before is
    # found by its numbers (8192 ranks: keying was half the time of the whole analysis)
    alike: dict[tuple[object, ...], tuple[Keys, int]] = {}
    numbers: dict[Keys, int] = {}
    paths: dict[int, UserPath] = {}

    def keyed(run: list[Collective]) -> tuple[list[Keys], tuple[int, ...]]:
        got = []
        for c in run:
            what = (c.op, c.pg, c.pg_desc, c.tag, c.source, c.name, id(c.frames),
                    id(c.input_sizes), id(c.dtypes))
            hit = alike.get(what)
            if hit is None:
                k = keys_of(c, paths)
                hit = alike[what] = (k, numbers.setdefault(k, len(numbers)))
            got.append(hit)
        return [k for k, _n in got], tuple([n for _k, n in got])

    for run in agreed_runs(views, bounds):
        ks, ids = keyed(run)
        p.learn(run, ks, ids)
        p.learn_period(run, ks)
    for r in views:  # across groups, in the order each thread of a rank posted them
        for order in views.thread_orders(r):
            agreed = [c for c in order if c.completed is not False
                      and ((b := bounds.get(c.pg)) is None or c.seq < b)]
            p.learn_order(agreed, *keyed(agreed))
    return p
