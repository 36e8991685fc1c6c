"""Per rank: every collective it is known to have posted, by group and sequence number, and
what it is doing now (its state, the collective it waits in, the user line) — pure.

Sources, richest first: the rank's Flight Recorder dump, the pending entries of its last
heartbeat, the worker's own posting log; stacks (py-spy, faulthandler, the probe's sample)
say where the main thread is (docs/DESIGN.md §8).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import cast

from moe_hang.analysis.diagnosis import (
    DEFAULT_PG,
    Divergence,
    Timeline,
    TimelineCell,
)
from moe_hang.evidence.flight_recorder import Collective, entry_to_collective
from moe_hang.evidence.model import RankEvidence
from moe_hang.evidence.ops import normalise_dtype, normalise_op
from moe_hang.evidence.probe_records import Heartbeat, PostedRecord
from moe_hang.evidence.source import SourceFacts
from moe_hang.evidence.stacks import (
    OS_THREAD_NAMES,
    Frame,
    StackView,
    collective_of,
    is_library_frame,
    thread_number,
)
from moe_hang.evidence.vocab import RankState


@dataclass
class RankTimeline:
    """Everything known about one rank's collectives, per process group."""

    by_pg: dict[str, dict[int, Collective]]
    enqueued: dict[str, int]  # last seq this rank posted, per pg (-1: none)
    completed: dict[str, int]
    has_data: bool


def _posted(rec: PostedRecord) -> Collective:
    return Collective(
        frames=rec.frames, pg=rec.pg, seq=rec.seq, op=normalise_op(rec.op),
        raw_op=f"probe:{rec.op}", pg_desc=rec.pg_desc, input_sizes=rec.input_sizes,
        dtypes=[normalise_dtype(rec.dtype)] if rec.dtype else [],
        time_created_ns=int(rec.time * 1e9) if rec.time else None, source="probe",
        name=rec.name, phase=rec.phase, tag=rec.tag, autograd_fn=rec.autograd_fn)


def beat_names(ev: RankEvidence, hb: Heartbeat) -> dict[str, str]:
    """The heartbeat's group ids (its recorder's own numbering) -> group names. A process
    numbers only the groups it belongs to, so an id is a name only through a record that
    holds both: a pending entry, the rank's recorder or its posted log. An id none names is
    read as the name only where every id named is its own name (the process numbers its
    groups as torch names them); else it is left out of every claim (a mesh rank's id "2"
    may be group "6", and group "2" another pair's)."""
    names = dict(ev.log_pg_names)
    if ev.fr is not None:
        names.update(ev.fr.pg_names)
    names.update({str(e.get("pg_id")): str(e["process_group"][0]) for e in hb.pending
                  if e.get("process_group")})
    as_is = all(k == v for k, v in names.items())
    return {pg_id: names.get(pg_id, pg_id) for pg_id in hb.pg_status or {}
            if pg_id in names or as_is}


def beat_counts(ev: RankEvidence, hb: Heartbeat) -> dict[str, tuple[int, int]]:
    """(posted, completed) per group from a heartbeat's recorder counts, by group name
    (``beat_names``). gloo counts ops there, its sends and recvs with its collectives: a
    count is brought back to collectives by how far the rank's newest recorded collective's
    op id was ahead of its seq (sends and recvs after it still count)."""
    names = beat_names(ev, hb)
    lead = dict(ev.log_op_lead)
    for name, n in (ev.fr.op_lead if ev.fr is not None else {}).items():
        lead[name] = max(lead.get(name, 0), n)  # the newer entry is the further ahead
    out = {}
    for pg_id, st in (hb.pg_status or {}).items():
        group = names.get(pg_id)
        if group is None:
            continue
        ahead = lead.get(group, 0)
        out[group] = (st.enqueued - ahead if st.enqueued >= 0 else st.enqueued,
                     st.completed - ahead if st.completed >= 0 else st.completed)
    return out


def timeline(ev: RankEvidence) -> RankTimeline:
    by_pg: dict[str, dict[int, Collective]] = {}
    enq: dict[str, int] = {}
    done: dict[str, int] = {}

    def add(c: Collective) -> None:
        slot = by_pg.setdefault(c.pg, {})
        if c.seq in slot:
            old = slot[c.seq]
            # keep the richer source but learn the probe's step name and phase
            old.name = old.name or c.name
            old.phase = old.phase or c.phase
            old.tag = old.tag or c.tag
            old.autograd_fn = old.autograd_fn or c.autograd_fn
            if not old.frames and c.frames:  # the posted log kept what a dump left out
                old.frames = c.frames
            old.thread_id = old.thread_id or c.thread_id
            if c.thread_name and (old.thread_name or "") in OS_THREAD_NAMES:
                old.thread_name = c.thread_name  # the Python name over the OS one
            return
        slot[c.seq] = c
        enq[c.pg] = max(enq.get(c.pg, -1), c.seq)

    if ev.fr is not None:
        for c in ev.fr.entries:
            add(c)
        for pg, st in ev.fr.pg_status.items():
            enq[pg] = max(enq.get(pg, -1), st.enqueued)
            done[pg] = max(done.get(pg, -1), st.completed)
    # the posted log: the history a rank kept past its end (gloo's abort, a kill), which a
    # saved recorder may predate, and the frames a tick's dump may lack
    for c in ev.posted_log:
        add(c)
    for pg, st in ev.log_status.items():
        enq[pg] = max(enq.get(pg, -1), st.enqueued)
        done[pg] = max(done.get(pg, -1), st.completed)
    hb = ev.heartbeat
    if (ev.fr is None or ev.fr_saved) and hb is not None and hb.pg_status is not None:
        # the heartbeat is fresher than a saved recorder: its counts say how far the rank got
        for name, (posted, completed) in beat_counts(ev, hb).items():
            enq[name] = max(enq.get(name, -1), posted)
            done[name] = max(done.get(name, -1), completed)
    for e in hb.pending if hb is not None else []:
        pending = entry_to_collective(e, source="heartbeat")
        if pending is not None:
            pending.completed = False
            add(pending)
    for rec in ev.records:
        add(_posted(rec))
    has = bool(by_pg) or ev.fr is not None
    for pg, coll in by_pg.items():
        if pg in done:
            for c in coll.values():
                # a group completes in order: its count is the rank's latest word, where an
                # entry's own "not yet" may be a copy's (the posted log, a beat) from before
                if c.completed is None or (ev.fr_saved and c.completed is False) \
                        or (c.completed is False and c.seq <= done[pg]):
                    c.completed = c.seq <= done[pg]
    _failed_in(ev, by_pg)
    return RankTimeline(by_pg, enq, done, has)


def _failed_in(ev: RankEvidence, by_pg: dict[str, dict[int, Collective]]) -> None:
    """A rank that raised inside a collective (a timeout, a closed connection) did not
    complete it, whatever the recorder counts: gloo retires a collective that failed."""
    if ev.error is None or not ev.error.frames:
        return
    op, _ = collective_of(ev.error.frames)
    if op is None or op == "unknown":
        return
    same = [c for coll in by_pg.values() for c in coll.values() if c.op == op]
    if same:
        max(same, key=lambda c: (c.time_created_ns or 0, c.seq)).completed = False


@dataclass
class RankView:
    ev: RankEvidence
    tl: RankTimeline
    stack: StackView
    state: RankState
    current: Collective | None  # the collective it is blocked in / last posted
    site: Frame | None
    # it moved during the capture: its stack, in a collective, is older than its recorder's
    # dump, which has that collective done (rankstate._went_past)
    moved: bool = False
    # the collective it posted right before ``current``, without a call site in its
    # recorder, and the line the source places it at (placing.posted_before)
    placed: tuple[Collective, Frame] | None = None
    # the collectives its own records leave pending, oldest first (rankstate._pending)
    pending: tuple[Collective, ...] = ()

    def user_frames_outer_first(self) -> list[Frame]:
        return [f for f in reversed(self.stack.frames) if not is_library_frame(f)]

    @property
    def position(self) -> list[Frame]:
        """Where the rank is (or was when it died), user frames outermost first, from the
        freshest source: its stack at capture, or the traceback it died with (both set
        ``stack``); else the frames of the collective it is blocked in."""
        if self.stack.frames:
            return self.user_frames_outer_first()
        if self.current is not None and self.current.frames:
            return [f for f in reversed(self.current.frames) if not is_library_frame(f)]
        return []


def group_kind(c: Collective) -> str:
    """Comparable across ranks: a mesh dim's groups share a description (``mesh_tp``), not a
    name (each rank's tp group is another group)."""
    return c.pg_desc if c.pg_desc and c.pg_desc != "undefined" else c.pg


PostingKey = tuple[str, int, str]  # (group kind, seq, op)


def posting_key(c: Collective) -> PostingKey:
    # a group's seq counts its collectives: in a program every rank runs alike, the n-th
    # collective of every tp group is the same step's, on every rank, ring buffer or not
    return (group_kind(c), c.seq, c.op)


def _posting_order(v: RankView) -> list[Collective]:
    """Every collective a rank posted, across its groups, in the order it posted them
    (record ids, else creation times); empty when neither orders all of them."""
    colls = [c for by_seq in v.tl.by_pg.values() for c in by_seq.values()]
    if colls and all(c.record_id is not None for c in colls):
        return sorted(colls, key=lambda c: c.record_id or 0)
    if colls and all(c.time_created_ns is not None for c in colls):
        return sorted(colls, key=lambda c: (c.time_created_ns or 0, c.pg, c.seq))
    return []


class RankViews(dict[int, RankView]):
    """Every rank's view for one diagnosis, and what is worked out once from all of them —
    on thousands of ranks the same is asked once per wait-for edge or cycle: each rank's
    posting order, and the memos of :mod:`moe_hang.analysis.order`. It lives as long as the
    diagnosis: nothing outlives it."""

    def __init__(self, views: Iterable[tuple[int, RankView]] = (),
                 source: SourceFacts | None = None) -> None:
        super().__init__(views)
        # what the source said of the capture's lines (nothing, where it was not read)
        self.source = source if source is not None else SourceFacts()
        self._order: dict[int, list[Collective]] = {}
        self._keys: dict[int, list[PostingKey]] = {}
        self.memo: dict[tuple[object, ...], object] = {}  # order's answers, by question

    def posting_order(self, r: int) -> list[Collective]:
        got = self._order.get(r)
        if got is None:
            got = self._order[r] = _posting_order(self[r])
        return got

    def thread_orders(self, r: int) -> list[list[Collective]]:
        """``r``'s posting order split by the thread that posted (the recorder's thread ids):
        two threads post independently, so only one thread's order says what followed what.
        One list where a collective's thread is not known."""
        memo = self.memo.get(("threads", r))
        if memo is None:
            order = self.posting_order(r)
            if not order or any(c.thread_id is None for c in order):
                memo = [order] if order else []
            else:
                split: dict[str, list[Collective]] = {}
                for c in order:
                    split.setdefault(c.thread_id or "", []).append(c)
                memo = list(split.values())
            self.memo[("threads", r)] = memo
        return cast(list[list[Collective]], memo)

    def order_with(self, r: int, c: Collective) -> list[Collective]:
        """The posting order of the thread of ``r`` that posted ``c`` (its whole order where
        threads are not known)."""
        for order in self.thread_orders(r):
            if any((x.pg, x.seq) == (c.pg, c.seq) for x in order):
                return order
        return self.posting_order(r)

    def latest_posts(self, r: int) -> dict[tuple[str, int], dict[str, int]]:
        """Per line of the job (any user frame of a recorded collective's stack), the latest
        seq ``r`` posted from there, per group kind: how many times it has been round the
        loop that holds the line, on a scale every rank shares."""
        got = self.memo.get(("posts", r))
        if got is None:
            posts: dict[tuple[str, int], dict[str, int]] = {}
            v = self.get(r)
            for pg in v.tl.by_pg.values() if v is not None else ():
                for c in pg.values():
                    kind = group_kind(c)
                    for f in c.frames:
                        if not is_library_frame(f):
                            at = posts.setdefault((f.file, f.line), {})
                            at[kind] = max(at.get(kind, c.seq), c.seq)
            got = self.memo[("posts", r)] = posts
        return cast(dict[tuple[str, int], dict[str, int]], got)

    def poster(self, r: int, pg: str) -> Poster | None:
        """The one thread of ``r`` that posted on ``pg`` (the recorder's thread ids), with
        its name and its last post there; None where several did or none is named."""
        v = self.get(r)
        posts = list(v.tl.by_pg.get(pg, {}).values()) if v is not None else []
        ids = {c.thread_id for c in posts if c.thread_id}
        number = thread_number(next(iter(ids))) if len(ids) == 1 else None
        if number is None:
            return None
        names = {c.thread_name for c in posts if c.thread_name}
        return Poster(number, names.pop() if len(names) == 1 else None,
                      max((c.time_created_ns or 0 for c in posts), default=0) / 1e9)

    def poster_ended(self, r: int, pg: str) -> bool:
        """The one thread of ``r`` that posted on ``pg`` is no longer among its threads (its
        stack at capture): that thread's collectives there are all it will ever post — it is
        not held up before the next one."""
        v = self.get(r)
        known = [t.thread_id for t in v.ev.threads] if v is not None and v.ev.threads else None
        p = self.poster(r, pg) if known else None
        live = {thread_number(t) for t in known or []}
        return p is not None and None not in live and p.number not in live

    def posting_keys(self, r: int) -> list[PostingKey]:
        got = self._keys.get(r)
        if got is None:
            got = self._keys[r] = [posting_key(c) for c in self.posting_order(r)]
        return got


@dataclass(frozen=True)
class Poster:
    """The one thread that posted a rank's collectives on a group."""

    number: int  # its pthread id (as the probe's thread records name it)
    name: str | None
    last: float  # when it posted its last there (s since the epoch; 0 where not known)


def _posted_upto(v: RankView, pg: str) -> int:
    """The last seq the rank's own counts say it posted on ``pg`` (-1: they say nothing)."""
    hb = v.ev.heartbeat
    beat = [] if hb is None else [(hb.pg_status or {}).get(i)
                                  for i, name in beat_names(v.ev, hb).items() if name == pg]
    return max((st.enqueued for st in ((v.ev.log_status or {}).get(pg), *beat)
                if st is not None), default=-1)


def build_timeline(views: RankViews, div: Divergence | None,
                   before: int = 6, after: int = 2) -> Timeline | None:
    """Per-rank collectives of one group around the divergence (ranks × sequence numbers)."""
    pg = div.pg if div is not None and div.pg != "?" else DEFAULT_PG
    seqs = sorted({s for v in views.values() for s in v.tl.by_pg.get(pg, {})})
    if not seqs:
        return None
    focus = div.seq if div is not None and div.pg == pg and div.seq is not None else seqs[-1]
    window = [s for s in seqs if focus - before <= s <= focus + after]
    rows: dict[int, list[TimelineCell | None]] = {}
    for r, v in sorted(views.items()):
        cells: list[TimelineCell | None] = []
        # a seq is counted on each rank in order: one it holds says every earlier was posted
        # (the timeline's count takes in every seq it holds)
        upto = max(_posted_upto(v, pg), v.tl.enqueued.get(pg, -1))
        for s in window:
            c = v.tl.by_pg.get(pg, {}).get(s)
            if c is None:
                # posted (its own counts say so) but not in its evidence: unknown, not missing
                cells.append(TimelineCell("?", [], "unknown") if s <= upto else None)
            else:
                state = ("done" if c.completed else
                         "pending" if c.completed is False else "posted")
                cells.append(TimelineCell(c.op, c.input_sizes, state, c.name))
        rows[r] = cells
    desc = next((c.pg_desc for v in views.values() for c in v.tl.by_pg.get(pg, {}).values()
                 if c.pg_desc), "")
    return Timeline(pg=pg, pg_desc=desc, seqs=window,
                    highlight=div.seq if div is not None and div.pg == pg else None, ranks=rows)
