"""The ground truth of a generated job, from the generator: the verdicts a careful reader of
the job accepts, the planted culprits, the line every rank is at (from :mod:`.simulate`, on
the programs of :mod:`.plant`) and the advice that would be wrong for it. Ranks are named
through environment variables (``FUZZ_AT_<MARKER>=0,2``: the ranks at that marker), so the
mirrored twin, whose roles are swapped, is checked against its own ranks.

For the kinds gloo pairs silently (:data:`SHIFTED`) the truth follows gloo's pairing, not the
sites: the divergence is the first collective of the planted group where the culprit's line
differs from the others' (where the shift starts, under watch, where the recorder shows it;
required on the others' line under a skip, on the culprit's under an extra), and each rank's
line is where it ends (a hang: its oldest collective that never completes), where gloo
aborted it (the members of the aborted collective that certainly end there) or inside the
framework's backward (broken)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from moe_hang.testing.fuzz.catalogue import SHIFTS, Kind
from moe_hang.testing.fuzz.events import Coll, Event, Fork, GroupKey
from moe_hang.testing.fuzz.plant import EXCEPTIONS, Plant, planted_group, programs
from moe_hang.testing.fuzz.simulate import Outcome, simulate
from moe_hang.testing.fuzz.sites import Family

# the corpus' verdict sets (tests/corpus/cases.py; a unit test keeps them equal)
HEALTHY = frozenset({"healthy", "straggler"})
STALLED = frozenset({"hang", "stalled", "stalled_outside_collectives"})
DESYNC = frozenset({"desync"})
DESYNC_OR_HANG = frozenset({"desync", "hang", "deadlock"})
CRASH = frozenset({"crash"})
RANK_DIED = frozenset({"rank_died"})

# advice that is wrong where the job does not call for it (case-insensitive substrings)
VARLEN = ("varlen", "VarlenDispatch", "DTensor.from_local", "3631")
ANCHOR = ("anchor",)
TRANSPORT = ("NCCL_DEBUG", "suspect the transport")
DTYPE = ("cast to one dtype",)
PAD = ("pad to a common size",)
SKIP = ("skip a layer", "skip an expert", "expert or exchange", "dummy input")
EXPERT = ("every expert",)
LOOP = ("left the loop",)
GROUP = ("same group",)

# the kinds whose truth follows gloo's pairing (a shift that may stay silent for a while)
SHIFTED = (*SHIFTS, "fsdp_eval")
WHERE_CODE = {"rank": "AT", "divergence": "DIV", "divergence?": "DIVQ",
              "rank+divergence": "ATDIV"}
CULPRITS_VAR = "CULPRIT_RANKS"


@dataclass(frozen=True)
class LineTruth:
    """The ranks in ``$var`` are at ``marker``, checked as the corpus' ``where``."""

    var: str
    marker: str
    where: str


@dataclass(frozen=True)
class RoleTruth:
    """The truth for one role assignment: its environment and the lines it names."""

    culprits: frozenset[int]
    env: dict[str, str]
    lines: frozenset[LineTruth]
    outcome: Outcome


@dataclass(frozen=True)
class Truth:
    verdicts: frozenset[str]
    primary: RoleTruth
    mirror: RoleTruth | None
    fix_forbid: tuple[str, ...] = ()
    fix_require: tuple[str, ...] = ()
    fix_none: bool = False
    summary_contains: str | None = None
    basis: frozenset[str] = frozenset()
    certainty: frozenset[str] = frozenset()

    @property
    def lines(self) -> tuple[LineTruth, ...]:
        both = self.primary.lines | (self.mirror.lines if self.mirror else frozenset())
        return tuple(sorted(both, key=lambda t: (t.marker, t.where)))

    def roles(self) -> list[RoleTruth]:
        return [self.primary] + ([self.mirror] if self.mirror else [])

    def envs(self) -> list[dict[str, str]]:
        """Each run's environment with every variable the lines name ('' where no rank
        is): the primary's, then the mirrored twin's."""
        names = sorted({t.var for t in self.lines})
        return [{**dict.fromkeys(names, ""), **rt.env} for rt in self.roles()]


def var(marker: str, where: str) -> str:
    return f"FUZZ_{WHERE_CODE[where]}_{marker.upper()}"


def _ranks(rs: set[int] | frozenset[int]) -> str:
    return ",".join(str(r) for r in sorted(rs))


def _shift(progs: list[list[Event]], culprit: int, waiter: int) -> tuple[str, str] | None:
    """Where two ranks' default-group collectives first differ (a module's all-gather
    skipped: the next one pairs silently with it): (culprit's marker, waiter's)."""
    a = [e for e in progs[culprit] if isinstance(e, Coll) and e.group == "world"]
    b = [e for e in progs[waiter] if isinstance(e, Coll) and e.group == "world"]
    for x, y in zip(a, b, strict=False):
        if (x.op, x.tag, x.ident) != (y.op, y.tag, y.ident):
            return x.marker, y.marker
    return None


def _on(prog: list[Event], group: GroupKey) -> list[Coll]:
    """The collectives a rank posts on ``group``, whichever of its threads posts them."""
    out: list[Coll] = []
    for e in prog:
        inner = e.events if isinstance(e, Fork) else (e,)
        out += [c for c in inner if isinstance(c, Coll) and c.group == group]
    return out


def _diverges(progs: list[list[Event]], group: GroupKey, culprit: int, ref: int
              ) -> tuple[int, Coll | None, Coll | None] | None:
    """The first collective of ``group`` where the culprit's and a rank's that is none
    differ (gloo pairs them by number, not by line): (number, the culprit's, the other's)."""
    a, b = _on(progs[culprit], group), _on(progs[ref], group)
    for i in range(max(len(a), len(b))):
        x, y = (a[i] if i < len(a) else None), (b[i] if i < len(b) else None)
        if x is None or y is None or (x.op, x.tag, x.marker, x.ident) != \
                (y.op, y.tag, y.marker, y.ident):
            return i, x, y
    return None


def visible_at(out: Outcome, mode: str) -> dict[int, str | None]:
    """Each rank's line as the evidence of ``mode`` can show it: under watch the collective
    the recorder and the probe name (one posted earlier and waited in ``work.wait()`` too);
    under diagnose, stacks alone, the line the stack shows (the wait, or the later
    collective the rank blocks in)."""
    return {r: out.hidden.get(r, m) if mode == "diagnose" else m for r, m in out.at.items()}


def _shifted_lines(family: Family, plant: Plant, progs: list[list[Event]], out: Outcome,
                   culprits: frozenset[int], mode: str,
                   put: Callable[[set[int], str, str], None]) -> None:
    """The lines of a kind gloo pairs silently (see the module's doc)."""
    others = set(range(family.world)) - culprits
    group = planted_group(family, plant)
    d = _diverges(progs, group, min(culprits), min(others))
    if mode == "watch" and d is not None:
        i, x, y = d
        posted = {r for r in range(family.world) if out.posted.get(r, {}).get(group, 0) > i}
        # the side that shows the fault is required there: the others' line under a skip
        # (the culprit's own next collective is incidental: "rank 1 skipped the one at ..."),
        # the culprit's under an extra; never a rank gloo may SIGABRT (no recorder is left)
        skip, c = plant.variant == "skip", min(culprits)
        if x is not None and (y is None or x.marker != y.marker) and c in posted:
            put({c}, x.marker, "divergence?" if skip or c in out.killed else "divergence")
        if y is not None and (x is None or x.marker != y.marker) and posted & others:
            shown = posted & others - out.killed if skip else set()
            if shown:
                put(shown, y.marker, "divergence")
            if posted & others - shown:
                put(posted & others - shown, y.marker, "divergence?")
    if out.state == "hang":
        for r, m in visible_at(out, mode).items():
            if m is not None:
                put({r}, m, "rank")
    elif out.state == "abort":
        for r in out.sure:
            put({r}, out.abort[r], "rank")
    elif out.state == "broken":
        for r in out.opaque:
            if (m := out.at.get(r)) is not None:
                put({r}, m, "rank")


def role_truth(family: Family, plant: Plant, kind: Kind, culprits: frozenset[int],
               mode: str = "watch") -> RoleTruth:
    progs = programs(family, plant, culprits)
    out = simulate(progs, family.members)
    env: dict[str, set[int]] = {}
    lines: set[LineTruth] = set()
    m: str | None

    def put(ranks: set[int], marker: str, where: str) -> None:
        t = LineTruth(var(marker, where), marker, where)
        lines.add(t)
        env.setdefault(t.var, set()).update(ranks)

    if kind.healthy or out.state in ("finished", "unknown"):
        pass
    elif kind.name in SHIFTED:
        _shifted_lines(family, plant, progs, out, culprits, mode, put)
    elif plant.kind == "skip" and plant.variant == "module":
        waiter = min(set(range(family.world)) - culprits)
        where = _shift(progs, min(culprits), waiter)
        if where is not None:
            put(set(culprits), where[0], "divergence?")
            put(set(range(family.world)) - culprits, where[1], "divergence")
    elif out.state == "abort":
        # the side that shows the fault is required: the culprit's collective where it met
        # the others' (its extra, its other op or size) — but under a skip the others' line,
        # the one it skipped, and the culprit's own next collective is incidental (as for
        # the kinds gloo pairs silently); never a rank gloo may SIGABRT (no recorder left)
        skip = plant.kind == "skip"
        for r, m in out.abort.items():
            shows = (r not in culprits and r not in out.killed) if skip else r in culprits
            put({r}, m, "divergence" if shows else "divergence?")
    else:
        for r, m in visible_at(out, mode).items():
            if m is not None:
                put({r}, m, "rank")
    full = {CULPRITS_VAR: _ranks(culprits), **{k: _ranks(v) for k, v in env.items()}}
    return RoleTruth(culprits, full, frozenset(lines), out)


def verdicts(kind: Kind, outcome: Outcome) -> frozenset[str]:
    if kind.healthy:
        return HEALTHY
    fixed = {"exception": CRASH, "early_exit": RANK_DIED, "sigkill": RANK_DIED,
             "lock": STALLED}
    if kind.name in fixed:
        return fixed[kind.name]
    return DESYNC if outcome.state == "abort" else DESYNC_OR_HANG


def advice(family: Family, plant: Plant, kind: Kind, mode: str = "watch"
           ) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(forbidden, required) substrings of the fix. Under diagnose (stacks only) a culprit
    that is past the collective shows no group: the fix cannot be required to name one. The
    kinds gloo pairs silently fall through every test below: none is a module skip (no dummy
    input, no expert), a size or dtype bug (the size abort they may end in is the pairing's,
    padding would not fix it), a rank that left the loop or a wrong group; none of them
    requires a word (what fixes it is a call every rank makes, or none does, which the tool
    may say in several ways)."""
    module_skip = plant.kind == "skip" and plant.variant == "module"
    forbid: list[str] = [*VARLEN, *ANCHOR, *TRANSPORT]
    require: list[str] = []
    if not (module_skip and family.experts):
        forbid += EXPERT
    if not module_skip:
        forbid += SKIP
    if plant.kind != "dtype":
        forbid += DTYPE
    if plant.kind != "size":
        forbid += PAD
    if plant.kind != "early_exit" and not (plant.kind == "skip" and plant.variant == "continue"):
        forbid += LOOP
    if plant.kind != "wrong_group":
        forbid += GROUP
    if plant.kind == "recv_no_send":
        require.append("send")
    elif plant.kind == "wrong_group" and mode == "watch":
        require.append("group")
    elif plant.kind == "dtype":
        require.append("dtype")
    elif module_skip and family.experts:
        require.append("expert")
    return tuple(forbid), tuple(require)


def truth(family: Family, plant: Plant, kind: Kind, culprits: frozenset[int],
          mirrored: frozenset[int], mode: str = "watch") -> Truth:
    """``mirrored``: the twin's culprits (empty: no twin); ``mode``: watch or diagnose."""
    primary = role_truth(family, plant, kind, culprits, mode)
    twin = role_truth(family, plant, kind, mirrored, mode) if mirrored else None
    forbid, require = advice(family, plant, kind, mode)
    summary: str | None = None
    basis: frozenset[str] = frozenset()
    certainty: frozenset[str] = frozenset()
    if kind.name == "exception":
        summary = EXCEPTIONS[plant.variant]
        basis, certainty = frozenset({"exception"}), frozenset({"definite"})
    elif kind.name in ("early_exit", "sigkill"):
        basis, certainty = frozenset({"exited"}), frozenset({"definite"})
        summary = "SIGKILL" if kind.name == "sigkill" else None
    if kind.healthy:  # a slow rank is none of the collective bugs
        forbid = (*VARLEN, *ANCHOR, *TRANSPORT, *DTYPE, *PAD, *SKIP, *EXPERT, *LOOP, *GROUP,
                  "post the collective", "same order")
    return Truth(verdicts(kind, primary.outcome), primary, twin,
                 fix_forbid=forbid,
                 fix_require=() if kind.healthy else require,
                 fix_none=kind.healthy, summary_contains=summary, basis=basis,
                 certainty=certainty)
