"""What to change, from the same facts as the summary (docs/DESIGN.md §8). The MoE-specific
fixes are offered only when the frames show their pattern; otherwise a plain, true sentence
naming the ranks and lines; no advice rather than wrong advice. Pure."""

from __future__ import annotations

from collections.abc import Callable

from moe_hang.analysis.blocks import EXTRA, Block
from moe_hang.analysis.diagnosis import CulpritBasis, MismatchKind, RankCollective, fmt_shape
from moe_hang.analysis.frames import fsdp_unshard, uses_dtensor_gather
from moe_hang.analysis.fsdp_advice import advise_behind, advise_fsdp_sync
from moe_hang.analysis.gates import (
    advise_gate,
    advise_gate_taken,
    advise_left_out,
    gate_taken,
    gates_a_pass_on,
    gates_in_their_pass,
    gates_passed,
    in_step,
    one_line,
    ways_left_out,
)
from moe_hang.analysis.loops import (
    advise_loop_left,
    advise_loop_stayed,
    advise_passes,
    ways_out,
    ways_past,
)
from moe_hang.analysis.passes import loop_left, stayed
from moe_hang.analysis.situation import (
    NOT_POSTED_THERE,
    Advice,
    Situation,
    at_line,
    collective_of_ranks,
    side_of,
    user_autograd_backward,
)
from moe_hang.analysis.source import (
    enclosing_loop,
    excludes_ranks,
    on_default_group,
    path_condition,
    path_condition_site,
    periodic_gate,
    taken_only_by,
)
from moe_hang.evidence.stacks import Frame, callsite, short_path
from moe_hang.evidence.vocab import agree, who


def advise_size(s: Situation) -> Advice:
    if (passes := advise_passes(s)) is not None:
        return passes  # two collectives of two passes met at one seq, not two shapes
    # each side's line: its call site, else the line of a rank whose report is inside that
    # very collective (a rank's line is where its pending collective was posted)
    lines = {(f.file, f.line) for r, c in s.div.per_rank.items()
             if c is not None and (f := c.callsite or _in_it(s, r)) is not None}
    if len(lines) > 1 and s.culprits and \
            s.basis not in (CulpritBasis.AMBIGUOUS, CulpritBasis.CYCLE):
        # posted from two lines: two different collectives that met at one seq (a rank
        # that left the loop, an extra), not one collective given two shapes
        return advise_order(s)
    lineless = [(r, c) for r in s.culprits if (c := s.div.per_rank.get(r)) is not None
                and c.callsite is None]
    unknown_line = [r for r, _ in lineless]
    theirs = next((c for r, c in sorted(s.div.per_rank.items())
                   if r not in s.culprits and c is not None and c.callsite is not None), None)
    if unknown_line and theirs is not None and len(lines) == 1 and \
            s.basis not in (CulpritBasis.AMBIGUOUS, CulpritBasis.CYCLE):
        # the culprits' line is not known: another call of theirs (an extra), or this one
        # with another shape — the advice for each, and what tells them apart
        return Advice(f"{who(unknown_line).capitalize()} posted {theirs.op} "
                      f"[{fmt_shape(lineless[0][1].input_sizes)}] where "
                      f"{who(s.waiting())} posted it at {at_line(theirs.callsite)} "
                      f"[{fmt_shape(theirs.input_sizes)}], and the recorder kept no line of "
                      f"{agree(unknown_line, 'it', 'theirs')}. Posted from another line, "
                      "that call is the extra: remove it or make every rank post it; from "
                      "this one, pass every rank the same shape (pad, or exchange the sizes "
                      "first).")
    if uses_dtensor_gather(s.all_frames()):
        return Advice(
            "DTensor.from_local(x, mesh, [Shard(0)]) exchanges no sizes: it assumes every rank "
            "holds the same number of rows. Exchange the lengths first and gather padded rows "
            "(all-gather the counts, pad to the max, all-gather, trim each piece): "
            "moe_hang.VarlenDispatch does this, with the gradient anchor.",
            "from moe_hang import VarlenDispatch\n"
            "y_TD = VarlenDispatch(ep_group)(x_TD, weights_TK, experts_TK, local_experts)")

    def shape(c: RankCollective) -> str:
        return fmt_shape(c.input_sizes) or ("?" if c.source == "stack" else "scalar")

    sizes = "; ".join(f"rank {r}: {shape(c)}"
                      for r, c in sorted(s.div.per_rank.items()) if c is not None)
    op = next((c.op for c in s.div.per_rank.values() if c is not None), "the collective")
    unknown = [r for r, c in sorted(s.div.per_rank.items()) if c is not None and not c.input_sizes]
    # gloo aborted it before it could say: shape or dtype, its bytes differ
    if unknown and any(c is not None and c.input_sizes for c in s.div.per_rank.values()):
        known = "; ".join(f"rank {r}: {shape(c)} {'/'.join(c.dtypes)}".rstrip()
                          for r, c in sorted(s.div.per_rank.items())
                          if c is not None and c.input_sizes)
        return Advice(f"Every rank must pass {op} the same number of bytes — the same shape "
                      f"and dtype ({known}; {who(unknown)}: not recorded, gloo aborted "
                      f"{agree(unknown, 'it', 'them')} first): check what {who(unknown)} "
                      f"{agree(unknown, 'passes', 'pass')} there, then make the shapes equal "
                      "(exchange the sizes first and send padded tensors) or give every rank "
                      "the same dtype, whichever differs.")
    return Advice(f"Every rank must pass the same shape to {op} ({sizes}): pad to a common "
                  "size, or exchange the sizes first (all-gather them) and send padded "
                  "tensors.")


def advise_dtype(s: Situation) -> Advice:
    dtypes = "; ".join(f"rank {r}: {'/'.join(c.dtypes)}" for r, c in sorted(s.div.per_rank.items())
                       if c is not None and c.dtypes)
    site = s.site(next(iter(sorted(s.div.per_rank))))
    return Advice(f"Cast to one dtype on every rank before the collective at {at_line(site)} "
                  f"({dtypes}).")


# what a branch under a rank condition that posts collectives must become
_ONE_ORDER = ("every rank must post the same collectives in the same order — run that branch's "
              "collectives on every rank (or on none, or outside the process group's), or post "
              "the same ones, in the same order, on both sides of it.")


def advise_condition(culprits: list[int], waiters: list[int], what: str, site: Frame | None,
                     cond: str, skipped: bool, cond_at: Frame | None = None) -> Advice:
    """A collective that a rank condition in the source lets only some members of its group
    post: the ranks it leaves out skipped it, or the ranks it lets in posted an extra.
    ``cond_at``: the condition's ``if`` (the fix is there)."""
    at = f" ({site.short()})" if site is not None else ""
    if skipped:
        return Advice(f"{who(culprits).capitalize()} {agree(culprits, 'does', 'do')} not take "
                      f"`{cond}`, so {agree(culprits, 'it', 'they')} never "
                      f"{agree(culprits, 'posts', 'post')} the {what}{at} that {who(waiters)} "
                      f"{agree(waiters, 'waits', 'wait')} in: every member of a group must "
                      "post its collectives — post it on every rank of the group, or on none.",
                      site=cond_at, site_why=f"the condition {who(culprits)} "
                      f"{agree(culprits, 'does', 'do')} not take")
    return Advice(f"{who(culprits).capitalize()} {agree(culprits, 'posts', 'post')} the {what}"
                  f"{at} under `{cond}`, which {who(waiters)} {agree(waiters, 'does', 'do')} "
                  "not take: " + _ONE_ORDER, site=cond_at,
                  site_why=f"the branch {who(culprits)} took")


def _advise_extra(s: Situation, b: Block) -> Advice:
    """Collectives only some ranks posted: the code that posted them runs only there."""
    site = b.site
    n = len(b.items)
    op = b.items[0].op if b.items else "collective"
    what = f"{n} {op}s" if n != 1 else f"the {op}"
    line = f"{short_path(site.file)}:{site.line}" if site is not None else ""
    at = (f" from {site.function}() at {line}" if site is not None
          and site.function != "<module>" else f" at {line}" if site else "")
    cond = f" under `{b.condition}`" if b.condition else ""
    head = (f"{who(b.having).capitalize()} {agree(b.having, 'posts', 'post')} {what}{at}"
            f"{cond} that {who(b.lacking)} never {agree(b.lacking, 'posts', 'post')}: ")
    if b.items and (b.by_fsdp or fsdp_unshard(b.items[0].frames)):
        return Advice(head + "FSDP all-gathers the parameters of every module it wraps when "
                      "the module is called, so a forward on some ranks only (an evaluation, "
                      "a logging pass) posts collectives the others never answer. Run it on "
                      "every rank (each on its own share of the data), or on a model outside "
                      "FSDP (an unsharded copy).")
    if b.data_branch:  # each rank's own data took the branch: every rank must post it
        return Advice(head + "post it on every rank every step, with a neutral value where "
                      "the branch is not taken (a zero to all-reduce), or decide the branch "
                      "on a value every rank agrees on.")
    return Advice(head + "run it on every rank, or outside the process group's collectives "
                  "(a rank-only evaluation, checkpoint or log must not post collectives).")


def _in_it(s: Situation, r: int) -> Frame | None:
    """The rank's line where its report is in the divergence's very collective."""
    rep = s.reports.get(r)
    c = rep.collective if rep is not None else None
    return rep.callsite if rep is not None and c is not None \
        and (c.pg, c.seq) == (s.div.pg, s.div.seq) else None


def advise_order(s: Situation) -> Advice:
    """A rank skipped (or reordered) a collective the others post."""
    back = next((f for r in s.waiting() if (f := user_autograd_backward(s.frames.get(r, [])))),
                None)
    if back is not None:
        return Advice(
            f"{who(s.waiting()).capitalize()} {agree(s.waiting(), 'runs', 'run')} a collective in "
            f"{back.function} "
            f"({back.short()}) that {who(s.culprits)}'s backward never reaches: its "
            "output does not depend on that function's input, so autograd skips it. Tie the "
            "output to the input (a gradient anchor) so every rank runs the same backward.",
            "y = y + x.sum() * 0  # gradient anchor: keeps x's backward in every rank's graph")
    if (passes := advise_passes(s)) is not None:
        return passes
    if s.block is not None and s.block.decided == EXTRA:
        if (inside := stayed(s)) is not None:
            # one more of a line every pass posts, in a loop the others have left
            theirs = s.block.lacking_next  # what the others posted there, not where now
            posted_at = callsite(list(theirs.frames)) if theirs is not None else None
            return advise_loop_stayed(s, inside, at_line(s.site(s.culprits[0])),
                                      at_line(posted_at or s.site(s.waiting()[0])))
        return _advise_extra(s, s.block)
    if s.culprits and s.basis not in (CulpritBasis.AMBIGUOUS, CulpritBasis.CYCLE) \
            and (taken := path_condition(s.src, s.frames.get(s.culprits[0], []))) is not None \
            and not excludes_ranks(taken) and taken_only_by(taken, s.culprits, s.waiting()) \
            and not fsdp_unshard(s.frames.get(s.culprits[0], [])):
        # the culprit is inside code only it runs (`if rank == 0: save_checkpoint()`): that
        # is the cause, whatever FSDP the others wait in
        return _advise_branch(s, taken,
                              path_condition_site(s.src, s.frames.get(s.culprits[0], [])))
    if s.lacks_fsdp_reduce():
        return advise_fsdp_sync(s)
    if s.lacks_fsdp_unshard() and s.behind and s.basis == CulpritBasis.MAJORITY:
        return advise_behind(s)
    if s.lacks_fsdp_unshard():
        called = s.waited_site()
        loop = enclosing_loop(s.src, called.file, called.line) if called is not None else None
        if called is not None and loop is not None and "expert" in loop.lower():
            return Advice(
                f"FSDP all-gathers a module's parameters when it is called; the loop at "
                f"{called.short()} called fewer modules on {who(s.culprits)} than on "
                f"{who(s.waiting())} (e.g. only the experts that got tokens). Call "
                "every expert on every rank every step, with an empty input where it has no "
                "token, so every rank posts the same all-gathers.",
                "for expert in experts:  # every expert, every step, on every rank\n"
                "    y = y.index_add(0, idx, expert(x[idx]))  # idx may be empty")
        if s.culprits and not fsdp_unshard(s.frames.get(s.culprits[0], [])) \
                and (left := loop_left(s, s.culprits[0])) is not None:
            # not a module skipped inside the forward: the culprit is out of the loop
            # that calls it (an iteration cut short by `continue`, or fewer of them)
            return advise_loop_left(s, left)
        # no line where the recorder kept no call site and the others' stacks are past it
        where = f"at {called.short()}" if called is not None else \
            f"(its {collective_of_ranks(s, s.waiting())}; no line recorded)"
        return Advice(
            f"FSDP all-gathers a module's parameters when it is called; "
            f"{who(s.culprits)} did not call the one {who(s.waiting())} called {where}. Call "
            "the same modules on every rank every step (run a skipped block on an empty or "
            "dummy input), so every rank posts the same all-gathers.")
    if s.basis in (CulpritBasis.AMBIGUOUS, CulpritBasis.CYCLE) or not s.culprits:
        # no line known (dumps without stack traces): the lines are what would settle it
        settle = (": compare the lines each rank is at (above)" if any(
            s.site(r) is not None for r in s.div.per_rank) else
            ", which holds no rank's line: torch's pickle dumps (with stack traces) or a "
            "run under `moe-hang watch` would show where each posted from")
        return Advice("Every rank must post the same collectives in the same order; these "
                      "ranks do not, and which one deviates is not decided by this capture"
                      f"{settle}.")
    culprit = s.culprits[0]
    missed_at = next((s.site(r) for r in s.waiting() if s.site(r) is not None), None)
    now_at = s.site(culprit)
    # where no line is known (dumps without stacks), the collectives say which
    missed = at_line(missed_at) if missed_at else collective_of_ranks(s, s.waiting())
    now = at_line(now_at) if now_at else collective_of_ranks(s, [culprit])
    the_missed = f"the collective at {missed}" if missed_at else missed
    # decided by a condition on the culprit's own path that names the ranks taking it
    cond = path_condition(s.src, s.frames.get(culprit, []))
    if cond is not None and not excludes_ranks(cond) and \
            taken_only_by(cond, s.culprits, s.waiting()):
        return _advise_branch(s, cond, path_condition_site(s.src, s.frames.get(culprit, [])))
    left_out = path_condition(s.src, s.frames.get(s.waiting()[0], [])) if s.waiting() \
        else None
    if left_out is not None and excludes_ranks(left_out) and cond is None and missed_at \
            and on_default_group(s.src, missed_at.file, missed_at.line) is True:
        # the others' collective, every rank's, runs under a branch that leaves ranks out;
        # the culprits' under none: they are the ones left out of it
        op = next((c.op for r, c in s.div.per_rank.items() if r in s.waiting() and c), "")
        # the ranks in that collective (not one held up elsewhere, in a send to a culprit)
        there = [r for r in s.waiting() if s.site(r) == missed_at]
        return advise_condition(s.culprits, there, op or "collective", missed_at,
                                left_out, True,
                                path_condition_site(s.src, s.frames.get(s.waiting()[0], [])))
    posted = next((s.frames[r] for r in s.waiting() if s.frames.get(r)), [])
    if missed_at is not None and (
            in_pass := gates_in_their_pass(s, culprit, posted, s.frames.get(culprit, [])))[0]:
        # later in the others' very pass, out of the function they wait in: past their call
        return advise_gate(s, culprit, missed_at, *in_pass)
    if missed_at is not None and \
            (found := gates_passed(s, culprit, posted, s.frames.get(culprit, []))):
        # the branch the culprit took past the others' collective
        return advise_gate(s, culprit, missed_at, found)
    if s.basis == CulpritBasis.MAJORITY and (out := loop_left(s, culprit)) is not None \
            and (ways_out(s, out) or ways_past(s, out)):
        # past a loop the others are still in: where the source shows a way out before its
        # end, or past their collective within a pass, the loop's advice names it beside the
        # count; without one, the order advice says what the stacks show
        return advise_loop_left(s, out)
    if s.basis == CulpritBasis.MAJORITY and now_at is not None and missed_at is not None \
            and one_line(s, now_at) and in_step(s) \
            and (g := gate_taken(s, now_at, missed_at)) is not None:
        # in step up to the collective before (one line for all): the culprits' path from
        # there took the branch theirs is in, the others' did not
        return advise_gate_taken(s, now_at, missed_at, g)
    if s.basis == CulpritBasis.MAJORITY and s.div.seq is None and now_at is not None \
            and missed_at is not None and one_line(s, now_at) \
            and (g := gate_taken(s, now_at, missed_at)) is not None \
            and periodic_gate(s.src, now_at.file, now_at.line) is None:
        # stacks alone: the minority waits in a branch of a test on its own data that the
        # others' line is outside of (a test alike in a pass would be out of step instead)
        return advise_gate_taken(s, now_at, missed_at, g)
    if s.basis == CulpritBasis.MAJORITY and now_at is not None and missed_at is not None \
            and not s.before.get(culprit) \
            and (a_pass_on := gates_a_pass_on(s, culprit, missed_at, now_at))[0]:
        # stacks alone, a pass on: it went through the others' line in their pass
        return advise_gate(s, culprit, missed_at, *a_pass_on)
    if s.basis == CulpritBasis.MAJORITY and (out := loop_left(s, culprit)) is not None \
            and all((c := s.div.per_rank.get(r)) is None or c.op not in NOT_POSTED_THERE
                    for r in s.waiting()):
        # past a loop the others are still in, no branch read: the loop's advice says both
        # ways it can be (it ran fewer passes or cut one short, or the others' extra) — where
        # the others' lines are where they posted (not a wait on what they posted earlier,
        # nor a send or a recv: the order advice says those)
        return advise_loop_left(s, out)
    if s.basis == CulpritBasis.MAJORITY:  # an extra collective, or a skipped one: both break it
        here = side_of(s, s.culprits, now, bool(now_at), "its collective")
        return Advice(f"{here[0].upper()}{here[1:]} where "
                      f"{side_of(s, s.waiting(), missed, bool(missed_at), 'theirs')}: every rank "
                      "must post the same collectives in the same order (a collective inside code "
                      "only some ranks run — a rank-0 evaluation, a skipped block — breaks it).")
    if (out := loop_left(s, culprit)) is not None:
        return advise_loop_left(s, out)
    if (inside := stayed(s)) is not None:
        return advise_loop_stayed(s, inside, now, missed)
    if now_at is not None and missed_at is not None and s.basis == CulpritBasis.HISTORY \
            and one_line(s, now_at) \
            and (g := gate_taken(s, now_at, missed_at)) is not None:
        # their collective broke what every step posted, inside a branch the others' is not
        return advise_gate_taken(s, now_at, missed_at, g)
    if s.div.seq is None and s.basis == CulpritBasis.SOURCE and now_at and missed_at \
            and len(ways := ways_left_out(s.src, missed_at, s.waiting(), s.culprits)) == 1:
        # stacks alone, a pass on past the others: the one way the loop has to post fewer
        return advise_left_out(s, ways[0], now_at, missed_at)
    if s.div.seq is None and s.div.kind == MismatchKind.MISSING:
        # stacks alone: the same op at a later line; whether it was skipped or posted on
        # another group, only the recorder's group names tell
        camps: dict[str, list[int]] = {}
        for r in s.culprits:
            camps.setdefault(at_line(site) if (site := s.site(r)) else "?", []).append(r)
        if len(camps) > 1:
            # past it at different lines: which of them share the waiters' group (and so
            # skipped it) the stacks do not say; some may be where they are because of it
            where = "; ".join(f"{who(rs)} at {at}" for at, rs in camps.items())
            return Advice(f"{who(s.waiting()).capitalize()} "
                          f"{agree(s.waiting(), 'waits', 'wait')} in {the_missed}; "
                          f"{who(s.culprits)} are past it ({where}): those of them in "
                          f"{agree(s.waiting(), 'its', 'their')} group skipped it or posted "
                          "it on another group, and the stacks do not say which ranks that "
                          "group holds. Make every rank of the group post it there; "
                          "`moe-hang watch` (Flight Recorder) names the groups.")
        return Advice(f"{who(s.culprits).capitalize()} went on to {now} without joining "
                      f"{who(s.waiting())} in {the_missed}: {agree(s.culprits, 'it', 'they')} "
                      "skipped it or posted it on another group. Make every rank post it, "
                      "on the same group; `moe-hang watch` (Flight Recorder) names the "
                      "groups.")
    return Advice(f"Make {who(s.culprits)} post {the_missed} too: it "
                  f"went on to {now} without it, and every rank must post the same "
                  "collectives in the same order.")


def _advise_branch(s: Situation, cond: str, cond_at: Frame | None) -> Advice:
    """The culprits took a branch under a rank condition that the others do not take
    (``cond_at``: its ``if``)."""
    culprit = s.culprits[0]
    missed_at = next((s.site(r) for r in s.waiting() if s.site(r) is not None), None)
    now_at = s.site(culprit)
    missed = at_line(missed_at) if missed_at else collective_of_ranks(s, s.waiting())
    now = at_line(now_at) if now_at else collective_of_ranks(s, [culprit])
    # the others where each is: one may have gone past the divergence (a recv of the next
    # step) while another still waits in it
    camps: dict[str, list[int]] = {}
    for r in s.waiting():
        rep = s.reports.get(r)
        site = rep.callsite if rep is not None and rep.callsite is not None else s.site(r)
        camps.setdefault(at_line(site) if site else missed, []).append(r)
    where = " and ".join(f"{who(rs)} at {at}" for at, rs in camps.items())
    others = (f"{who(s.waiting())} {agree(s.waiting(), 'waits', 'wait')} at {missed}"
              if len(camps) < 2 else f"the others are elsewhere ({where})")
    return Advice(f"{who(s.culprits).capitalize()} took `{cond}`, a branch the others do "
                  f"not take, and {agree(s.culprits, 'waits', 'wait')} there at {now} "
                  f"while {others}: " + _ONE_ORDER, site=cond_at,
                  site_why=f"the branch {who(s.culprits)} took")


# what each mismatch kind advises (a row per kind of analysis.mismatch.KINDS)
KIND_ADVICE: dict[MismatchKind, Callable[[Situation], Advice]] = {
    MismatchKind.OP: advise_order,
    MismatchKind.SIZE: advise_size,
    MismatchKind.DTYPE: advise_dtype,
    MismatchKind.MISSING: advise_order,
    MismatchKind.ORDER: advise_order,
    MismatchKind.EXTRA: advise_order,
}
