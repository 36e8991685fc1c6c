"""What a rank is doing now: whose stack says so (its main thread, or the one of its
threads inside a collective), its state, the collective it waits in, and the line that
posted it — by whichever thread posted it — pure (docs/DESIGN.md §8).
"""

from __future__ import annotations

from dataclasses import replace

from moe_hang.analysis.diagnosis import RankCollective
from moe_hang.analysis.frames import fsdp_unshard
from moe_hang.analysis.placing import held_behind, posted_before
from moe_hang.analysis.timeline import RankTimeline, RankView, timeline
from moe_hang.evidence.flight_recorder import Collective
from moe_hang.evidence.model import RankEvidence
from moe_hang.evidence.ops import normalise_op
from moe_hang.evidence.source import SourceFacts
from moe_hang.evidence.stacks import (
    Frame,
    StackView,
    ThreadStack,
    callsite,
    is_tool_frame,
    main_thread,
    other_thread,
    parse_faulthandler,
    thread_number,
    view,
)
from moe_hang.evidence.vocab import RankState


def _threads(ev: RankEvidence) -> tuple[StackView, str | None]:
    if ev.threads:
        return _posting_thread(ev.threads), ev.stack_source
    if ev.fatal and "File " in ev.fatal:
        return view(main_thread(parse_faulthandler(ev.fatal))), "fatal"
    frames = ev.heartbeat.frames() if ev.heartbeat is not None else []
    if frames:
        # the probe's sample of the main thread, which cannot tell on-CPU from waiting: the
        # watcher's measure of the rank's movement does (a remote rank's summary has no
        # py-spy stack; outside collectives, unmoving, it is idle — not unknown)
        # (with the send/recv it sampled the thread inside, and its peer)
        hb = ev.heartbeat
        return view(ThreadStack("MainThread", frames, is_main=True, active=ev.progressed,
                                thread_id=(hb.main_thread or "") if hb else "",
                                p2p=hb.p2p if hb else None)), "probe"
    return StackView(RankState.UNKNOWN), None


def _posting_thread(threads: list[ThreadStack]) -> StackView:
    """The rank's main thread — unless it is outside every collective while another thread
    of the job's (a metrics or logging thread on a group of its own) is inside one: the rank
    waits there, and the line is that thread's, whichever thread the program is in."""
    main = view(main_thread(threads))
    if main.state == RankState.IN_COLLECTIVE:
        return main
    inside = [v for t in threads if not t.is_main and t.frames
              and not is_tool_frame(t.frames[-1])
              and (v := view(t)).state == RankState.IN_COLLECTIVE]
    if len(inside) == 1:
        t = next(t for t in threads if not t.is_main and view(t) == inside[0])
        inside[0].thread = t.name or t.thread_id
        return inside[0]
    return main


def _pending(tl: RankTimeline) -> list[Collective]:
    out: list[Collective] = []
    for coll in tl.by_pg.values():
        out.extend(c for c in coll.values() if c.completed is False)
    return sorted(out, key=lambda c: (c.time_created_ns or 0, c.seq))


def _newest(tl: RankTimeline, current: Collective, pending: list[Collective]) -> bool:
    """``current`` is the one collective pending and the last the rank posted, on any group."""
    return pending == [current] and current.time_created_ns is not None and all(
        (c.time_created_ns or 0) <= current.time_created_ns
        for coll in tl.by_pg.values() for c in coll.values())


def recorder_only(ev: RankEvidence) -> bool:
    """All the tool has of this live, stuck rank is its Flight Recorder dump (post-mortem:
    ``analyze`` on torch's dump files)."""
    return (ev.fr is not None and ev.alive is True and ev.progressed is False
            and not ev.threads and ev.heartbeat is None and not ev.fatal)


def _waits_async(ev: RankEvidence, sv: StackView, facts: SourceFacts | None,
                 newest: bool = False) -> StackView | None:
    """The rank's main thread sits at its own line's wait (``work.wait()``) in every sample:
    in a collective posted earlier, as NCCL jobs wait (blocked, or spinning in a stream's
    synchronize). Where the source shows which call posted it, that is its op and its line
    (a rank's line is where its pending collective was posted); else its op is unknown.
    ``newest``: the one collective pending is the rank's newest, so a wait on a list's
    handles waits on the last one appended (nothing was posted after it)."""
    if facts is None or ev.progressed is not False or sv.callsite is None \
            or sv.state not in (RankState.IDLE, RankState.COMPUTING):
        return None
    at = sv.callsite
    lf = facts.line(at.file, at.line)
    if lf is None or lf.waits is None or lf.wait_on is False:
        return None  # no wait here, or one the source shows is on something else
    if lf.posted is None and newest and lf.appended_last is not None:
        lf = replace(lf, posted=lf.appended_last)
    if lf.posted is None:
        return replace(sv, state=RankState.IN_COLLECTIVE, op=sv.op or "unknown",
                       api=sv.api or f"{lf.waits}()")
    posted = Frame(at.file, lf.posted[0], at.function)
    return replace(sv, state=RankState.IN_COLLECTIVE, op=normalise_op(lf.posted[1]),
                   api=lf.posted[1], callsite=posted, waited_at=at,
                   frames=[posted if f == at else f for f in sv.frames])


# what gloo's and NCCL's recorders record when posted (not send/recv: gloo records none; not
# monitored_barrier: send/recv underneath)
_RECORDED = frozenset({"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast",
                       "reduce", "gather", "scatter", "barrier"})


def _went_past(ev: RankEvidence, sv: StackView) -> bool:
    """The rank's stack is in a collective its recorder records, and its recorder, dumped
    on request during the same capture (not the probe's older periodic save), has nothing
    pending though it holds collectives of that kind: it recorded the stack's collective when
    the rank posted it, before the stack was taken, and saw it complete — or the rank posted
    it after the dump. Either way the rank moved during the capture: the stack and the dump are
    taken side by side, and on a loaded machine the stack can be seconds the older."""
    fr = ev.fr
    if fr is None or ev.fr_saved or sv.op not in _RECORDED or sv.api == "monitored_barrier":
        return False
    return any(normalise_op(c.op) == sv.op for c in fr.entries) \
        and all(c.completed is not False for c in fr.entries)


def _in_call(pending: list[Collective], sv: StackView) -> Collective | None:
    """Of several collectives pending, the one whose call the stack is inside (its op, posted
    from the stack's own line by the stack's thread), where every one posted before it is an
    FSDP unshard: FSDP waits for its all-gather before the module it gathers runs, so a rank
    past that module is past it (its recorder marks completion late). A collective the user
    posted with ``async_op=True`` before may still be in flight ahead of the call (gloo runs a
    group's collectives in order): the rank is held there, the oldest. None otherwise."""
    if len(pending) < 2 or sv.op is None or sv.callsite is None or sv.waited_at is not None:
        return None
    here = (sv.callsite.file, sv.callsite.line)
    found = [c for c in pending if normalise_op(c.op) == sv.op and c.frames
             and not other_thread(c.thread_id, sv.thread_id)
             and (s := callsite(c.frames)) is not None and (s.file, s.line) == here]
    if not found:
        return None
    older = pending[:next(k for k, c in enumerate(pending) if c is found[-1])]
    return found[-1] if all(fsdp_unshard(c.frames) for c in older) else None


def rank_view(ev: RankEvidence, facts: SourceFacts | None = None,
              done: frozenset[tuple[str, int]] = frozenset()) -> RankView:
    """``facts``: what the source says of the rank's lines (a wait at its own line).
    ``done``: (group, seq) of collectives its own records leave pending that its peers' show
    done (:mod:`moe_hang.analysis.peer_done`)."""
    tl = timeline(ev)
    for pg, seq in done:
        tl.by_pg[pg][seq].completed = True
    sv, source = _threads(ev)
    if source and not ev.stack_source:
        ev.stack_source = source
    # a rank held alive after it raised has failed there: it is not waiting, nor moving;
    # nor is one whose main thread the capture caught in an excepthook, recording it
    exited = ev.alive is False or (ev.exit_code is not None and ev.alive is not True) \
        or (ev.error is not None and (ev.held or _in_excepthook(ev)))
    pending = _pending(tl)
    current: Collective | None = _in_call(pending, sv) or (pending[0] if pending else None)
    state: RankState
    moved = False
    if exited:
        state = RankState.EXITED
        if ev.exit_code == 0:
            # finished cleanly: whatever its last heartbeat saw has long completed
            current, sv = None, StackView(RankState.UNKNOWN)
        else:
            if current is None:
                # nothing pending: it died in its last one — or in a send/recv gloo does
                # not record, where the stack it died with is (below)
                last = [c for coll in tl.by_pg.values() for c in coll.values()]
                current = max(last, key=lambda c: (c.time_created_ns or 0, c.seq)) \
                    if last else None
            if current is not None and _died_with(source) and sv.op and sv.op != current.op \
                    and sv.callsite is not None:
                # it died inside another collective than its last recorded one: that record
                # was older than the rank's last steps (a fast loop, a starved probe thread);
                # the stack it died with is fresher (docs/DESIGN.md §8.1) — a fatal
                # signal's, or the one dumped when its launcher ended it (SIGTERM)
                current = None
            elif current is not None and pending and current is pending[0] \
                    and not (ev.error is not None and ev.error.frames) \
                    and (held := held_behind(sv, facts, pending)) is not None:
                sv = held  # it died held behind its older post: as a live rank (below)
    elif sv.state != RankState.UNKNOWN:
        state = sv.state
        if state == RankState.IN_COLLECTIVE and current is None and _went_past(ev, sv):
            state, moved = RankState.COMPUTING, True  # the fresher source wins (§8.1)
        elif state != RankState.IN_COLLECTIVE and current is not None and not ev.progressed:
            state = RankState.IN_COLLECTIVE  # FR says a collective is pending, nothing moved
            waiting = _waits_async(ev, sv, facts, _newest(tl, current, pending))
            if waiting is not None and waiting.waited_at is not None and not current.frames \
                    and waiting.op == current.op:
                # a recorder without call sites: its line is where the source shows the
                # handle it waits on was posted, not the wait's
                sv = waiting
        elif (waiting := _waits_async(ev, sv, facts)) is not None:
            state, sv = RankState.IN_COLLECTIVE, waiting  # in a collective it posted earlier
        elif state == RankState.IN_COLLECTIVE and (held := held_behind(sv, facts, pending)):
            sv = held  # behind a collective it posted earlier, in the next one's call
    elif current is not None:
        state = RankState.IN_COLLECTIVE
    elif recorder_only(ev):
        # a dump written while the rank was stuck, with nothing pending in it: the rank was
        # outside every collective the recorder saw (in a send/recv gloo does not record, in
        # a sleep, a lock, a read); where exactly, only its stack would say
        state = RankState.IDLE
    else:
        state = RankState.UNKNOWN
    if state == RankState.EXITED and ev.error is not None and ev.error.frames:
        # it died raising: the raising line, not that of its last (long finished) collective
        site = callsite(ev.error.frames)
    else:
        site = _posting_site(current, sv, current, state, tl) or (
            None if _posted_elsewhere(ev, current, sv) else sv.callsite)
    return RankView(ev, tl, sv, state, current, site, moved,
                    posted_before(tl, sv, current, facts) if site == sv.callsite else None,
                    tuple(pending))


def _died_with(source: str | None) -> bool:
    """The stack was taken as the rank ended: a fatal signal's faulthandler dump, the probe's
    dump on the SIGTERM that ended it, or the traceback of the exception it raised."""
    return source is not None and ("fatal" in source or source in (
        "faulthandler (sigterm)", "exception traceback"))


def _in_excepthook(ev: RankEvidence) -> bool:
    """The main thread is in an excepthook (torch's, the probe's): the program has raised."""
    t = main_thread(ev.threads or [])
    out = t.frames[-1] if t is not None and t.frames else None
    return out is not None and ("excepthook" in out.function
                                or (is_tool_frame(out) and out.function.endswith("hook")))


def _posted_elsewhere(ev: RankEvidence, coll: Collective | None, sv: StackView) -> bool:
    """``coll`` was posted by another thread than the one ``sv`` is, and ``sv``'s line is
    not where: that thread is inside a collective of its own, or the poster is one of the
    job's threads (with lines of the job's on its stack). A collective the autograd engine's
    thread posted (DDP's buckets, FSDP's reduce-scatters on a GPU) has no line of its own:
    the main thread's ``backward()`` is its line."""
    if coll is None or not other_thread(coll.thread_id, sv.thread_id):
        return False
    if sv.op is not None:
        return True
    poster = thread_number(coll.thread_id or "")
    return any(thread_number(t.thread_id) == poster and callsite(t.frames) is not None
               for t in ev.threads or [] if t.thread_id)


def posting_site(coll: Collective | None, v: RankView) -> Frame | None:
    """The user line that posted ``coll`` on this rank (with no collective: where its stack
    is) — the one rule for every place that names a line (:func:`site_key` compares them)."""
    if coll is not None and v.placed is not None and not coll.frames \
            and (coll.pg, coll.seq) == (v.placed[0].pg, v.placed[0].seq):
        return v.placed[1]
    return _posting_site(coll, v.stack, v.current, v.state, v.tl)


def site_key(c: Collective) -> tuple[str, object] | None:
    """Where ``c`` was posted, comparable across ranks and steps: the recorder's line, else
    the probe's step name; None when neither is known."""
    site = callsite(c.frames) if c.frames else None
    if site is not None:
        return (site.file, site.line)
    return ("probe", c.name) if c.name else None


def posted_after(tl: RankTimeline, c: Collective, thread_id: str | None) -> bool:
    """The thread posted another collective of ``c``'s group after it: it has returned from
    ``c``'s call, and its stack, in a collective call, is in a later one."""
    if c.seq is None or tl.enqueued.get(c.pg, -1) <= c.seq:
        return False  # nothing of the group after it (asked for every entry of a tail)
    return any(s > c.seq and not other_thread(e.thread_id, thread_id)
               for s, e in tl.by_pg.get(c.pg, {}).items())


def _posting_site(coll: Collective | None, sv: StackView, pending: Collective | None,
                  state: RankState, tl: RankTimeline | None = None) -> Frame | None:
    """The recorder's frames are exact; a stack is exact while it is still inside that same
    collective (same op, and ``coll`` is the one pending) — the stack of the thread that
    posted it: another thread's stack never places it (a rank's main thread in ``join()``
    while its metrics thread waits in its all-reduce); the probe's own record, taken just
    before the call, points near it."""
    if coll is not None and coll.frames and coll.source != "probe":
        return callsite(coll.frames)
    # an ended rank died in its last one; never in one of its group it had gone past
    went_past = pending is not None and pending.pg == coll.pg and pending.seq > coll.seq \
        if coll is not None else False
    in_it = coll is None or (
        sv.op == coll.op and not other_thread(coll.thread_id, sv.thread_id)
        and not (tl is not None and posted_after(tl, coll, sv.thread_id))
        and (pending is None or (state == RankState.EXITED and not went_past)
             or (pending.pg, pending.seq) == (coll.pg, coll.seq)))
    if in_it and sv.callsite is not None:
        return sv.callsite
    if coll is not None and coll.frames:
        return callsite(coll.frames)
    return None


def to_rc(c: Collective | None, v: RankView) -> RankCollective | None:
    """A collective of this rank, as the diagnosis shows it, with the line that posted it."""
    if c is None:
        return None
    site = posting_site(c, v)
    return RankCollective(op=c.op, pg=c.pg, seq=c.seq, input_sizes=c.input_sizes,
                          dtypes=c.dtypes, source=c.source, pg_desc=c.pg_desc,
                          time_created_ns=c.time_created_ns, tag=c.tag, callsite=site,
                          state=c.state)
