"""The conclusions where no collective diverged: ranks waiting for one outside any
collective, a straggler, a job finishing one rank at a time, every rank moving, every rank in
one collective that does not complete, and too little evidence to say (pure)."""

from __future__ import annotations

from moe_hang.analysis.activity import Motion
from moe_hang.analysis.advice import Advice
from moe_hang.analysis.conclusion import Conclusion
from moe_hang.analysis.diagnosis import (
    Certainty,
    CulpritBasis,
    Divergence,
    RankReport,
    Verdict,
    pg_label,
)
from moe_hang.analysis.dumps_only import outside_recorded
from moe_hang.analysis.explain import error_text, site_str, waits_text
from moe_hang.analysis.facts import Facts, working_helper
from moe_hang.analysis.passes import loop_at, loop_between
from moe_hang.analysis.rankstate import recorder_only
from moe_hang.evidence.stacks import Frame, Helper, callsite, idle_in_backward, thread_number
from moe_hang.evidence.vocab import RankState, agree, who


def outside_collectives(f: Facts) -> list[int]:
    """Waiting ranks that are not inside a collective (idle in a sleep, a lock, a read).
    Where no rank's stack shows a collective, ranks idle inside the autograd engine wait in
    their backward's collectives (DDP's and FSDP's hooks post them there, on threads py-spy
    does not show): the others are outside (a rank deadlocked on two locks before its
    forward while the rest sit idle in ``loss.backward()``)."""
    out = sorted(r for r in f.waiting if f.views[r].state != RankState.IN_COLLECTIVE)
    back = [r for r in out if idle_in_backward(f.views[r].stack)]
    if 0 < len(back) < len(f.waiting):
        return [r for r in out if r not in back]
    return out


def some_outside(f: Facts) -> bool:
    """Some of the waiting ranks, not all, are outside any collective."""
    return 0 < len(outside_collectives(f)) < len(f.waiting)


def stalled_outside(f: Facts) -> Conclusion:
    culprits = outside_collectives(f)
    reports = f.reports(None)
    w = waits_text(f, reports)
    div = next((g.div for g in f.divs if set(g.absent) & set(culprits)), None)
    site = f.views[culprits[0]].site
    if all(recorder_only(f.views[r].ev) for r in culprits):
        return outside_recorded(f, culprits, w, div)
    left = _left_for_good(f, culprits)
    if left is not None:
        return _left_loop(f, culprits, left, div)
    if div is not None and (ended := _poster_ended(f, culprits, div, w)) is not None:
        return ended
    where = "; ".join(f"rank {r} at {site_str(f.views[r].site)}" for r in culprits)
    back = [r for r in f.waiting if r not in culprits and idle_in_backward(f.views[r].stack)]
    if back and not w:
        sites = sorted({site_str(f.views[r].site) for r in back})
        w = f"{who(back)}, idle inside backward at {', '.join(sites)},"
    # one waiter only where the text names one rank ("ranks 1-3 in ..." is three)
    one = w.startswith("rank ") and w.count("rank") == 1
    helper = _stuck_helper(f, culprits[0])
    held = (f": it waits on its {helper.kind} (pid {helper.pid}), itself stuck at "
            f"{site_str(helper.site)}," if helper is not None else "")
    summary = (f"{who(culprits).capitalize()} {agree(culprits, 'is', 'are')} outside any "
               f"collective ({where}){held} while "
               f"{w or 'the others'} wait{'s' if one else ''} for it.")
    look = (f"Look at what rank {culprits[0]}'s {helper.kind} does at "
            f"{site_str(helper.site)}" if helper is not None else
            f"Look at what rank {culprits[0]} does at {site_str(site)}")
    return Conclusion(Verdict.HANG, culprits, CulpritBasis.WAITED_FOR, Certainty.UNCERTAIN,
                      summary,
                      Advice(f"{look}: until it reaches the collective the others wait in, they "
                             "wait (slow I/O or a checkpoint resolves by itself; a stuck data "
                             "loader does not)."),
                      div)


def _poster_ended(f: Facts, culprits: list[int], div: Divergence, w: str) -> Conclusion | None:
    """Every culprit's one thread that posted on the group the others wait in has ended (it
    is not among its threads at capture): that thread will never post that collective — a
    hang, not a slow rank. Where it recorded the exception that ended it, that is the cause
    (definite); else likely (another thread of the rank may yet post there)."""
    if not all(f.views.poster_ended(c, div.pg) for c in culprits):
        return None
    c = culprits[0]
    p = f.views.poster(c, div.pg)
    if p is None:  # (poster_ended found the one)
        return None
    # the poster's own exception: by its id, raised after its last post there (a pthread id
    # is reused: an earlier thread's exception under the same id is not this one's)
    err = next((e for e in f.views[c].ev.thread_errors if e.thread_id is not None
                and thread_number(e.thread_id) == p.number
                and (e.time is None or e.time >= p.last)), None) if len(culprits) == 1 else None
    name = err.thread if err is not None and err.thread else p.name
    thread = f"thread {name}" if name else "thread"
    group = pg_label(div.pg, div.pg_desc)
    them = w or "the others"
    now = "; ".join(f"rank {r} at {site_str(f.views[r].site)}" for r in culprits)
    if err is not None:
        site = callsite(err.frames)
        at = f" at {site.short()}" if site else ""
        summary = (f"Rank {c}'s {thread} raised {error_text(err)}{at} and ended: it posted "
                   f"rank {c}'s collectives on {group}, so {them} wait for one it will never "
                   f"post ({now}).")
        return Conclusion(
            Verdict.HANG, [c], CulpritBasis.EXCEPTION, Certainty.DEFINITE, summary,
            Advice(f"Fix the {err.type.rsplit('.', 1)[-1]} rank {c}'s {thread} raised{at}. A "
                   "thread that posts collectives must not end on one rank alone: catch its "
                   "exception and hand it to the main thread (raise it there, so the rank "
                   "fails instead of hanging), or stop every rank.",
                   site=site, site_why="where its thread raised"), div)
    summary = (f"{who(culprits).capitalize()}'s {thread} that posted on {group} has ended: "
               f"{them} wait for a collective it will never post ({now}).")
    # likely: another thread of the rank may yet post there (a new one each epoch)
    return Conclusion(
        Verdict.HANG, culprits, CulpritBasis.WAITED_FOR, Certainty.LIKELY, summary,
        Advice(f"{who(culprits).capitalize()}'s {thread} posted fewer collectives on {group} "
               "than the others' and ended: make every rank's thread post as many (the same "
               "count of items, the same end), or end them together."), div)


def _left_for_good(f: Facts, culprits: list[int]) -> Frame | None:
    """The loop every culprit has left, for good (no loop around both brings it back), while
    every rank waiting for it is still inside."""
    waiters = [r for r in f.waiting if r not in culprits]
    if not waiters:
        return None
    loops = {loop_between(f.views.source, f.views[c].stack.frames,
                          [f.views[r].stack.frames for r in waiters], for_good=True)
             for c in culprits}
    return loops.pop() if len(loops) == 1 else None


def _left_loop(f: Facts, culprits: list[int], loop: Frame,
               div: Divergence | None) -> Conclusion:
    """Ranks outside any collective past a loop the others still wait in: they will not
    post that loop's collectives again, so the wait is theirs — they posted fewer of them
    (a skipped one, or fewer passes)."""
    where = "; ".join(f"rank {r} at {site_str(f.views[r].site)}" for r in culprits)
    waiting = [r for r in f.waiting if r not in culprits]
    sites = sorted({site_str(f.views[r].site) for r in waiting})
    them = agree(culprits, "it", "them")
    summary = (f"{who(culprits).capitalize()} left the loop at {loop_at(loop)} and "
               f"{agree(culprits, 'is', 'are')} outside any collective ({where}), while "
               f"{who(waiting)}, still inside it, {agree(waiting, 'waits', 'wait')} for "
               f"{them} at {', '.join(sites)}: nothing brings {them} back to that loop.")
    return Conclusion(Verdict.HANG, culprits, CulpritBasis.PROGRAM_ORDER, Certainty.LIKELY,
                      summary,
                      Advice(f"{who(culprits).capitalize()} posted fewer of the loop's "
                             f"collectives than {who(waiting)}: "
                             f"{agree(culprits, 'it', 'they')} skipped one (an `if`, "
                             "`continue` or `break` on a rank's own data) or ran fewer "
                             "passes. Post every collective of a pass on every rank, and give "
                             "each rank the same number of passes.", site=loop,
                             site_why=f"the loop {who(culprits)} left"),
                      div)


def _stuck_helper(f: Facts, r: int) -> Helper | None:
    """The one child process of ``r`` that sits off CPU at a line of the job's own (a
    DataLoader worker blocked in ``__getitem__``): what the rank waits on."""
    # ``site`` is already the job's own line (a helper only in library code has none)
    found = [h for h in f.views[r].ev.helpers if h.busy is False and h.site is not None]
    return found[0] if len(found) == 1 else None


def finishing(f: Facts) -> Conclusion:
    """A rank's program ended, having posted every collective the others wait in: they are
    returning from the last ones (a job finishing one rank at a time), not left waiting."""
    done = f.finishing
    waits = sorted({(pg_label(c.pg, c.pg_desc), c.seq) for r in f.waiting
                    if (c := f.views[r].current) is not None})
    upto = ", ".join(f"{pg} #{seq}" for pg, seq in waits)
    # uncertain: a claim about a job still running, which watch keeps watching
    return Conclusion(Verdict.HEALTHY, [], CulpritBasis.NONE, Certainty.UNCERTAIN,
                      f"{who(done).capitalize()} finished after posting every collective "
                      f"{who(f.waiting)} {agree(f.waiting, 'waits', 'wait')} in"
                      f"{f' ({upto})' if upto else ''}: "
                      f"{agree(f.waiting, 'it is', 'they are')} returning from "
                      f"{agree(f.waiting, 'its', 'their')} last collectives, not left "
                      "waiting.")


def straggler(f: Facts) -> Conclusion:
    culprits = sorted(f.moving)
    # a rank idle on its own helper's work: where that work was seen
    through = "".join(f" (rank {r} through its {h.kind}, pid {h.pid}, at {site_str(h.site)})"
                      for r in culprits if f.views[r].state != RankState.COMPUTING
                      and (h := working_helper(f.views[r])) is not None)
    return Conclusion(Verdict.STRAGGLER, culprits, CulpritBasis.WAITED_FOR, Certainty.UNCERTAIN,
                      f"{who(culprits).capitalize()} {'is' if len(culprits) == 1 else 'are'} "
                      f"still computing{through} while {who(f.waiting)} "
                      f"wait{'s' if len(f.waiting) == 1 else ''} in a collective: slow, not "
                      "deadlocked.",
                      Advice("Not a deadlock: a rank is still computing while the others wait. "
                             "Look at what it computes (its stack); balance the work, or raise "
                             "the timeout."))


def all_moving(f: Facts) -> Conclusion:
    # the counters first: they saw collectives complete, where a stack saw one collective
    counted = sorted(r for r in f.alive
                     if (j := f.activity.get(r)) is not None and j.motion == Motion.MOVING)
    moved = sorted(r for r in f.alive if r not in counted and f.views[r].moved)
    stacked = sorted(r for r in f.alive if r not in counted and r not in moved)
    parts = []
    if stacked:
        parts.append("their stacks moved between samples" if not (counted or moved)
                     else f"{who(stacked)}'s stack moved between samples" if len(stacked) == 1
                     else f"the stacks of {who(stacked)} moved between samples")
    if moved:
        one = len(moved) == 1
        ops = {f.views[r].stack.op or "a collective" for r in moved}
        op = ops.pop() if len(ops) == 1 else "collectives"
        parts.append(f"{who(moved)} {'was' if one else 'were'} in {op} in "
                     f"{'its stack' if one else 'their stacks'}, but "
                     f"{'its recorder' if one else 'their recorders'}, dumped beside "
                     f"{'it' if one else 'them'}, had every collective completed: "
                     f"{'it' if one else 'they'} moved on during the capture")
    if counted:
        ops = {f.views[r].stack.op or "a collective" for r in counted}
        op = ops.pop() if len(ops) == 1 else "collectives"
        one = len(counted) == 1
        parts.append(f"{who(counted)} {'was' if one else 'were'} in {op} in every sample, a "
                     f"new one each time: {'its main thread' if one else 'their main threads'}"
                     f" kept waking and {'its process' if one else 'their processes'} kept "
                     "moving data through syscalls (counters in the evidence)")
    head = (f"All {len(f.alive)} ranks are" if len(f.alive) > 1
            else f"{who(f.alive).capitalize()} is")
    gone = [r for r in f.exited if r not in f.bad_exit]
    ended = (f" ({who(gone)} {'has' if len(gone) == 1 else 'have'} finished: "
             "exited normally)") if gone else ""
    return Conclusion(Verdict.HEALTHY, [], CulpritBasis.NONE, Certainty.LIKELY,
                      f"{head} making progress{ended}: {'; '.join(parts)}. No hang right "
                      "now.")


def all_in_one(f: Facts) -> Conclusion:
    reports = f.reports(None)
    ops = {_waits_in(f, reports, r) for r in f.waiting}
    op = ops.pop() if len(ops) == 1 else "collectives"
    if op == "unknown":  # every one at its own line's wait: what it waits on, posted earlier
        op = "collectives they posted earlier (a wait at their own line)"
    stopped = sorted(r for r in f.waiting if (a := f.views[r].ev.activity) is not None
                     and a.stopped)
    if all(f.views[r].ev.fr is not None for r in f.waiting):
        summary = (f"All {len(f.waiting)} ranks wait in {op} with matching order and sizes, "
                   "and it does not complete: the collective order is consistent, so the "
                   "cause is outside it")
    else:  # stacks (or heartbeats) alone show where each waits, not what it posted before
        lines = {(cs.file, cs.line) for r in f.waiting
                 if (cs := reports[r].callsite) is not None}
        # at several lines that no evidence here orders: which side deviated is not known
        where = (f" at {len(lines)} lines, and none completes (which rank deviated the "
                 "stacks do not say)") if len(lines) > 1 else ", and it does not complete"
        summary = (f"All {len(f.waiting)} ranks wait in {op}{where}"
                   + ("" if stopped else
                      "; without every rank's Flight Recorder dump their collective order "
                      "and sizes cannot be compared (run it under `moe-hang watch`, whose "
                      "probe keeps the recorder)"))
    summary += (f": {who(stopped)}'s process is stopped (SIGSTOP, job control)." if stopped
                else ".")
    nccl = any(v.ev.fr is not None and v.ev.fr.backend == "nccl" for v in f.views.values())
    text = ("Suspect the transport or a device (NCCL_DEBUG=INFO shows the rings; a peer "
            "outside this job, a hung GPU)." if nccl else "")
    return Conclusion(Verdict.HANG, [], CulpritBasis.NONE, Certainty.UNCERTAIN, summary,
                      Advice(text))


def _waits_in(f: Facts, reports: dict[int, RankReport], r: int) -> str:
    """The op a rank waits in: its recorded collective's, else its stack's ("backward" for a
    rank idle in the autograd engine, "?" where nothing says)."""
    if (c := reports[r].collective) is not None:
        return c.op
    return f.views[r].stack.op or ("backward" if f.views[r].stack.in_backward else "?")


def in_one(f: Facts) -> bool:
    return bool(f.waiting) and len(f.waiting) == len(f.alive)


def progress_unseen(f: Facts) -> Conclusion:
    """Every rank sat in the same kind of collective in every sample, and nothing shows
    whether it is one that never completes or a new one each time (docs/DESIGN.md §9)."""
    reports = f.reports(None)
    ops = {_waits_in(f, reports, r) for r in f.waiting}
    op = ops.pop() if len(ops) == 1 else "collectives"
    whys: dict[str, list[int]] = {}
    for r in f.waiting:
        j = f.activity.get(r)
        whys.setdefault(j.why if j is not None and j.motion != Motion.STUCK
                        else "no counters" if j is None else "", []).append(r)
    clauses = [f"{who(rs)}: {w}" for w, rs in whys.items() if w and w != "no counters"]
    if "no counters" in whys:
        clauses.append(f"{who(whys['no counters'])}: no counters were read")
    summary = (f"All {len(f.waiting)} ranks were in {op} in every sample, and what their "
               "processes did cannot tell one collective that never completes from a new one "
               "each time (" + "; ".join(clauses) + ").")
    text = ("Decide with the recorder: keep watch's probe in the ranks (the launch script "
            "dropped it: let it keep PYTHONPATH, or call torchrun by name), or `moe-hang "
            "diagnose PID --fr-dir DIR` with the job's own Flight Recorder dumps."
            if f.ev.sampled else
            "Decide with the recorder: run the job under `moe-hang watch -- <launch command>` "
            "(its probe reads the Flight Recorder's sequence numbers), or pass `--fr-dir DIR` "
            "with the job's own Flight Recorder dumps (TORCH_FR_BUFFER_SIZE, "
            "TORCH_FR_DUMP_TEMP_FILE).")
    return Conclusion(Verdict.INCONCLUSIVE, [], CulpritBasis.NONE, Certainty.UNCERTAIN, summary,
                      Advice(text))


def inconclusive(f: Facts) -> Conclusion:
    """Nothing decides: what is known, what is missing, and what would settle it."""
    known = [r for r, v in f.views.items() if v.state != RankState.UNKNOWN]
    missing = [r for r, v in f.views.items() if v.state == RankState.UNKNOWN]
    dumps = [r for r in known if recorder_only(f.views[r].ev)]
    summary = "Not enough evidence to name a cause: " + (
        f"states known for {who(known)} only." if known
        else "no stack or recorder data could be read.")
    if missing and dumps:
        summary += (f" {who(missing).capitalize()} left no Flight Recorder dump here (a rank "
                    "ended by a signal, gloo's abort included, writes none).")
    # gloo retires a collective that raised as it does one that completed (measured: every
    # entry after the failed one retired, pg_status's completed count short of them)
    retired = [r for r in dumps if f.views[r].state == RankState.IDLE
               and (fr := f.views[r].ev.fr) is not None and fr.backend == "gloo"]
    if retired:
        rec, holds = agree(retired, "recorder", "recorders"), agree(retired, "holds", "hold")
        summary += (f" The {rec} of {who(retired)} {holds} nothing pending, but gloo "
                    "retires a collective that failed as one that completed: the dumps "
                    "cannot say whether the last ones failed.")
    settle = ([f"{who(missing)}'s dump or log (how it ended)"] if missing and known else []) + [
        "the job's log (its first error names the rank and the collective)",
        "or a run under `moe-hang watch -- <launch command>`, whose probe keeps every rank's "
        "collectives on disk to its end (a SIGABRT or SIGKILL too)"]
    return Conclusion(Verdict.INCONCLUSIVE, [], CulpritBasis.NONE, Certainty.UNCERTAIN,
                      summary, Advice("What would settle it: " + "; ".join(settle) + "."))
