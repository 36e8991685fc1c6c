"""What advice is given from (:class:`Situation`), what it is (:class:`Advice`), and the
patterns of the frames that decide which fix applies (DTensor's gather, FSDP's unshard, a
user ``autograd.Function``) — pure; the advice itself is :mod:`.advice`'s."""

from __future__ import annotations

from dataclasses import dataclass, field

from moe_hang.analysis.blocks import Block
from moe_hang.analysis.diagnosis import CulpritBasis, Divergence, RankReport, pg_label
from moe_hang.analysis.frames import fsdp_reduce, fsdp_unshard
from moe_hang.analysis.source import on_default_group
from moe_hang.evidence.source import SourceFacts
from moe_hang.evidence.stacks import Frame, in_backward, is_library_frame
from moe_hang.evidence.vocab import agree, who


@dataclass
class Situation:
    """What advice is given from: the divergence, the blame, and each rank's frames there
    (the stack that posted its collective, else its stack now; innermost first)."""

    div: Divergence
    culprits: list[int]
    basis: CulpritBasis
    reports: dict[int, RankReport]
    frames: dict[int, list[Frame]] = field(default_factory=dict)
    block: Block | None = None  # where one side posted collectives the other did not
    src: SourceFacts = field(default_factory=SourceFacts)  # what the source said
    # every culprit is behind every waiting rank where each is now (position_order: an
    # earlier line of one iteration, by the source and the loop counters); False: not known
    behind: bool = False
    # the stack each rank posted its last collective on the divergence's group from
    before: dict[int, list[Frame]] = field(default_factory=dict)
    # the last seq each rank posted, per group (its counts), and when it was posted
    enqueued: dict[int, dict[str, int]] = field(default_factory=dict)
    posted_ns: dict[int, dict[str, int]] = field(default_factory=dict)
    before_ns: dict[int, int] = field(default_factory=dict)  # when ``before`` was posted
    # each rank's loop counters on its stack (``step``: 3), where py-spy read them
    counters: dict[int, dict[str, int]] = field(default_factory=dict)

    def all_frames(self) -> list[Frame]:
        return [f for fs in self.frames.values() for f in fs]

    def site(self, r: int) -> Frame | None:
        """The line that posted the rank's collective at the divergence; else where the rank
        is, unless that is in a later collective of the group (it went on: its line now is
        not the divergence's)."""
        c = self.div.per_rank.get(r)
        if c is not None and c.callsite is not None:
            return c.callsite
        rep = self.reports.get(r)
        if rep is None or (c is not None and c.seq is not None and rep.collective is not None
                           and rep.collective.pg == c.pg and rep.collective.seq is not None
                           and rep.collective.seq > c.seq):
            return None
        return rep.callsite

    def waiting(self) -> list[int]:
        """The ranks the culprits leave waiting (every other member with an entry)."""
        return [r for r in sorted(self.div.per_rank) if r not in self.culprits]

    def waited_site(self) -> Frame | None:
        """The line the first waiting rank with one waits at."""
        return next((site for r in self.waiting() if (site := self.site(r)) is not None), None)

    def lacks_fsdp_unshard(self) -> bool:
        """The collective the culprits lack is FSDP's pre-forward all-gather: FSDP's unshard
        is in the frames, the waiters' line does not call a collective itself (a skipped
        broadcast is no module), and the block the culprits lack, where known, is FSDP's."""
        waited = self.waited_site()
        if self.lacks_fsdp_reduce() or (waited is not None and on_default_group(
                self.src, waited.file, waited.line) is not None):
            return False
        lacked = self.block.items[0].frames if self.block is not None and self.block.items \
            else []
        return fsdp_unshard(self.all_frames()) and (not lacked or fsdp_unshard(lacked))


    def lacks_fsdp_reduce(self) -> bool:
        """The collective the culprits lack is FSDP's gradient reduction after a backward
        (the waiting ranks' frames show it), where they all-gathered parameters instead,
        inside their backward: their gradient sync was off there, or that module was not in
        their forward."""
        waiting = [f for r in self.waiting() for f in self.frames.get(r, [])]
        mine = [f for r in self.culprits for f in self.frames.get(r, [])]
        # inside a backward too: one in the next forward skipped this backward (a guard)
        return bool(self.culprits) and fsdp_reduce(waiting) and fsdp_unshard(mine) \
            and not fsdp_reduce(mine) and in_backward(mine)


@dataclass
class Advice:
    text: str
    code: str | None = None  # a snippet to paste at the user's line
    site: Frame | None = None  # the line it is about, where that is not the culprit's
    site_why: str | None = None  # what that line is to the culprit ("the branch rank 1 took")


def grad_hook(frames: list[Frame]) -> Frame | None:
    """The user function that posted the collective from inside backward, called by the
    autograd engine itself (a gradient hook: ``register_post_accumulate_grad_hook``, a
    tensor hook), if any: where a parameter gets no gradient, it never runs."""
    for i, f in enumerate(frames):
        if not is_library_frame(f):
            outer = frames[i + 1:]
            return f if outer and is_library_frame(outer[0]) and in_backward(outer) else None
    return None


def user_autograd_backward(frames: list[Frame]) -> Frame | None:
    """The user ``autograd.Function.backward`` frame that posted the collective, if any."""
    for f in frames:
        if not is_library_frame(f) and f.function.rsplit(".", 1)[-1] == "backward":
            return f
    return None


def at_line(f: Frame | None) -> str:
    return f.short() if f is not None else "its line"


def collective_of_ranks(s: Situation, ranks: list[int]) -> str:
    """The collective these ranks posted at the divergence, else are in (no line known)."""
    for r in ranks:
        c = s.div.per_rank.get(r) or (s.reports[r].collective if r in s.reports else None)
        if c is not None:
            seq = f"#{c.seq}" if c.seq is not None else ""
            return f"{c.op} {pg_label(c.pg, c.pg_desc)}{seq}"
    return "its collective"


# a stack's op that is not a collective posted at the stack's line
NOT_POSTED_THERE = frozenset({"unknown", "send", "recv"})


def side_of(s: Situation, ranks: list[int], where: str, is_line: bool, what: str) -> str:
    """``rank 0 posted its collective at f.py:61`` — or, where the stacks show these ranks in
    a wait (``work.wait()``) whose collective no evidence names, ``ranks 1-5 wait at f.py:60 on
    collectives they posted earlier``: a wait is not where anything was posted; nor is a
    send or a recv (``rank 1 waits in a send at f.py:47``). Ranks at other lines, each at
    its own."""
    if not is_line:
        return f"{who(ranks)} posted {where}"
    camps: dict[tuple[str, str], list[int]] = {}
    for r in ranks:
        c, site = s.div.per_rank.get(r), s.site(r)
        camps.setdefault((c.op if c is not None else "?", at_line(site) if site else where),
                         []).append(r)
    parts = []
    for (op, at), rs in camps.items():
        if op == "unknown":
            parts.append(f"{who(rs)} {agree(rs, 'waits', 'wait')} at {at} on "
                         f"{agree(rs, 'a collective it', 'collectives they')} posted earlier")
        elif op in ("send", "recv"):
            parts.append(f"{who(rs)} {agree(rs, 'waits', 'wait')} in a {op} at {at}")
        else:
            mine = what if len(camps) == 1 else agree(rs, "its collective", "theirs")
            parts.append(f"{who(rs)} posted {mine} at {at}")
    return ", ".join(parts[:-1]) + (" and " if len(parts) > 1 else "") + parts[-1]
