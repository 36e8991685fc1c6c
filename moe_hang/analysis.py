"""From evidence to a verdict (pure: no torch, no rich, no processes).

The core question is the one NCCL never answers: did every rank post the same collectives in
the same order with the same sizes? Per process group, entries are aligned across member ranks
by sequence number (Flight Recorder first, then the probe's own records and heartbeats for
ranks without a dump); the first sequence number where they differ is the divergence.
Stacks say what each rank is doing now; exit codes and error records say who died.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass
from itertools import pairwise

from moe_hang.diagnosis import (
    DEFAULT_PG,
    Diagnosis,
    Divergence,
    RankCollective,
    RankReport,
    fmt_shape,
    pg_label,
)
from moe_hang.evidence import Evidence, RankEvidence, said_exiting
from moe_hang.frtrace import SAME_SIZE_OPS, Collective, entry_to_collective, normalise_op
from moe_hang.stacks import (
    Frame,
    StackView,
    callsite,
    main_thread,
    parse_faulthandler,
    parse_probe_frames,
    short_path,
    view,
)

_DTYPE_NAMES = {
    "torch.float32": "Float", "torch.float": "Float", "torch.float16": "Half",
    "torch.half": "Half", "torch.bfloat16": "BFloat16", "torch.float64": "Double",
    "torch.int64": "Long", "torch.long": "Long", "torch.int32": "Int", "torch.int": "Int",
    "torch.int8": "Char", "torch.uint8": "Byte", "torch.bool": "Bool",
}


def _dtype(name: str) -> str:
    return _DTYPE_NAMES.get(name, name)


# ----------------------------------------------------------------------------- per-rank timelines


@dataclass
class RankTimeline:
    """Everything known about one rank's collectives, per process group."""

    by_pg: dict[str, dict[int, Collective]]
    enqueued: dict[str, int]  # last seq this rank posted, per pg (-1: none)
    completed: dict[str, int]
    has_data: bool


def _record_to_collective(rec: dict) -> Collective | None:
    try:
        seq = int(rec["seq"])
    except (KeyError, TypeError, ValueError):
        return None
    return Collective(
        frames=parse_probe_frames(rec.get("frames")),
        pg=str(rec.get("pg", DEFAULT_PG)), seq=seq, op=normalise_op(str(rec.get("op", "?"))),
        raw_op=f"probe:{rec.get('op')}", pg_desc=str(rec.get("pg_desc", "")),
        input_sizes=[list(map(int, s)) for s in rec.get("input_sizes") or []],
        dtypes=[_dtype(str(rec["dtype"]))] if rec.get("dtype") else [],
        time_created_ns=int(float(rec["time"]) * 1e9) if rec.get("time") else None,
        source="probe", name=rec.get("name"), phase=rec.get("phase"), tag=rec.get("tag"),
        autograd_fn=rec.get("autograd_fn"))


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
            return
        slot[c.seq] = c
        enq[c.pg] = max(enq.get(c.pg, -1), c.seq)

    if ev.fr is not None:
        for c in ev.fr.entries:
            add(c)
        for pg, st in ev.fr.pg_status.items():
            enq[pg] = max(enq.get(pg, -1), st["enqueued"])
            done[pg] = max(done.get(pg, -1), st["completed"])
    hb = ev.heartbeat or {}
    if ev.fr is None and isinstance(hb.get("pg_status"), dict):
        names = {str(e.get("pg_id")): str(e["process_group"][0]) for e in hb.get("pending") or []
                 if isinstance(e, dict) and e.get("process_group")}
        for pg_id, st in hb["pg_status"].items():
            try:
                name = names.get(str(pg_id), str(pg_id))
                enq[name] = max(enq.get(name, -1), int(st["enqueued"]))
                done[name] = max(done.get(name, -1), int(st["completed"]))
            except (KeyError, TypeError, ValueError):
                continue
    for e in hb.get("pending") or []:
        pending = entry_to_collective(e, source="heartbeat") if isinstance(e, dict) else None
        if pending is not None:
            pending.completed = False
            add(pending)
    for rec in ev.records:
        logged = _record_to_collective(rec)
        if logged is not None:
            add(logged)
    has = bool(by_pg) or ev.fr is not None
    for pg, coll in by_pg.items():
        if pg in done:
            for c in coll.values():
                if c.completed is None:
                    c.completed = c.seq <= done[pg]
    return RankTimeline(by_pg, enq, done, has)


# ----------------------------------------------------------------------------- rank views


@dataclass
class RankView:
    ev: RankEvidence
    tl: RankTimeline
    stack: StackView
    state: str
    current: Collective | None  # the collective it is blocked in / last posted
    site: Frame | None


def _exit_desc(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


def _threads(ev: RankEvidence) -> tuple[StackView, str | None]:
    if ev.threads:
        return view(main_thread(ev.threads)), ev.stack_source
    if ev.fatal and "File " in ev.fatal:
        return view(main_thread(parse_faulthandler(ev.fatal))), "fatal"
    frames = parse_probe_frames((ev.heartbeat or {}).get("main_frame"))
    if frames:
        from moe_hang.stacks import ThreadStack

        return view(ThreadStack("MainThread", frames, is_main=True)), "probe"
    return StackView("unknown"), None


def _pending(tl: RankTimeline) -> list[Collective]:
    out: list[Collective] = []
    for coll in tl.by_pg.values():
        out.extend(c for c in coll.values() if c.completed is False)
    return sorted(out, key=lambda c: (c.time_created_ns or 0, c.seq))


def rank_view(ev: RankEvidence) -> RankView:
    tl = timeline(ev)
    sv, source = _threads(ev)
    if source and not ev.stack_source:
        ev.stack_source = source
    exited = ev.alive is False or (ev.exit_code is not None and ev.alive is not True)
    pending = _pending(tl)
    current: Collective | None = pending[0] if pending else None
    if exited:
        state = "exited"
        if ev.exit_code == 0:
            # finished cleanly: whatever its last heartbeat saw has long completed
            current, sv = None, StackView("unknown")
        elif current is None:
            last = [c for coll in tl.by_pg.values() for c in coll.values()]
            current = max(last, key=lambda c: (c.time_created_ns or 0, c.seq)) if last else None
    elif sv.state != "unknown":
        state = sv.state
        if state != "in_collective" and current is not None and not ev.progressed:
            state = "in_collective"  # FR says a collective is pending and nothing moved
    elif current is not None:
        state = "in_collective"
    else:
        state = "unknown"
    site = _posting_site(current, sv, current, state) or sv.callsite
    return RankView(ev, tl, sv, state, current, site)


def _posting_site(coll: Collective | None, sv: StackView, pending: Collective | None,
                  state: str) -> Frame | None:
    """The user line that posted ``coll`` (with no collective: where the stack is). The
    recorder's frames are exact; a stack is exact while it is still inside that same
    collective (same op, and ``coll`` is the one pending); the probe's own record, taken just
    before the call, points near it. The one rule for every place that names a line."""
    if coll is not None and coll.frames and coll.source != "probe":
        return callsite(coll.frames)
    in_it = coll is None or (sv.op == coll.op and (
        pending is None or state == "exited" or (pending.pg, pending.seq) == (coll.pg, coll.seq)))
    if in_it and sv.callsite is not None:
        return sv.callsite
    if coll is not None and coll.frames:
        return callsite(coll.frames)
    return None


# ----------------------------------------------------------------------------- alignment


def _members(views: dict[int, RankView], world: int | None) -> dict[str, list[int]]:
    members: dict[str, set[int]] = {}
    for r, v in views.items():
        for pg, ranks in (v.ev.groups or {}).items():
            members.setdefault(pg, set()).update(ranks)
        if v.ev.fr is not None:
            for pg, ranks in v.ev.fr.pg_ranks.items():
                if pg in v.tl.by_pg:
                    members.setdefault(pg, set()).update(ranks)
        for pg in v.tl.by_pg:
            members.setdefault(pg, set()).add(r)
    all_ranks = set(range(world)) if world else set(views)
    members.setdefault(DEFAULT_PG, set()).update(all_ranks)
    members[DEFAULT_PG].update(all_ranks)
    return {pg: sorted(rs) for pg, rs in members.items()}


def _ops_match(a: Collective, b: Collective) -> bool:
    if a.op == b.op:
        return True
    # gloo implements DTensor's reduce-scatter as an all-reduce; the probe names the intent.
    mixed = "probe" in (a.source, b.source) and a.source != b.source
    return mixed and {a.op, b.op} <= {"reduce_scatter", "all_reduce"}


def _to_rc(c: Collective | None, v: RankView) -> RankCollective | None:
    if c is None:
        return None
    site = _posting_site(c, v.stack, v.current, v.state)
    return RankCollective(op=c.op, pg=c.pg, seq=c.seq, input_sizes=c.input_sizes,
                          dtypes=c.dtypes, source=c.source, pg_desc=c.pg_desc,
                          time_created_ns=c.time_created_ns, tag=c.tag,
                          callsite=_site_dict(site))


@dataclass
class Found:
    div: Divergence
    culprits: list[int]
    time_ns: int


def _blocked_elsewhere(v: RankView) -> bool:
    """Known not to be on its way to the missing collective: dead, or seen not moving. A
    single snapshot of a live rank proves nothing (it may be one step behind, computing)."""
    if v.state == "exited":
        return True
    return v.state in ("idle", "in_collective") and v.ev.progressed is False


def align(views: dict[int, RankView], world: int | None) -> Found | None:
    """The earliest sequence number, in any group, where member ranks disagree."""
    found: list[Found] = []
    for pg, members in _members(views, world).items():
        with_data = [r for r in members if r in views and views[r].tl.has_data]
        if len(with_data) < 2 and not any(views[r].tl.by_pg.get(pg) for r in with_data):
            continue
        seqs = [set(views[r].tl.by_pg.get(pg, {})) for r in with_data]
        nonempty = [s for s in seqs if s]
        if not nonempty:
            continue
        lo = max(min(s) for s in nonempty)  # older entries may have left a ring buffer
        hi = max(max(s) for s in nonempty)
        for seq in range(lo, hi + 1):
            present = {r: views[r].tl.by_pg.get(pg, {}).get(seq) for r in with_data}
            have = {r: c for r, c in present.items() if c is not None}
            if not have:
                continue
            absent = [r for r, c in present.items()
                      if c is None and views[r].tl.enqueued.get(pg, -1) < seq]
            kind = _mismatch_kind(list(have.values()))
            tag_culprits: list[int] | None = None
            if kind is None:
                tag_culprits = _skipped_by_tag(pg, seq, have, views)
                if tag_culprits is not None:
                    kind = "missing_rank"
            if kind is None and absent:
                stuck = [r for r in absent if _blocked_elsewhere(views[r])]
                waiting = [r for r, c in have.items() if c.completed is not True]
                if stuck and waiting and len(stuck) == len(absent):
                    kind = "missing_rank"
            if kind is None:
                continue
            first = next(iter(have.values()))
            per_rank = {r: _to_rc(present.get(r), views[r]) for r in with_data}
            phase = next((c.phase for c in have.values() if c.phase), None)
            if phase is None and any(c.frames and _frames_in_backward(c.frames)
                                     for c in have.values()):
                phase = "backward"
            div = Divergence(pg=pg, seq=seq, kind=kind, pg_desc=first.pg_desc,
                             members=members, per_rank=per_rank, phase=phase)
            if tag_culprits is not None:
                culprits = tag_culprits
            elif kind == "missing_rank":
                culprits = absent
            else:
                culprits = _culprits(have, views)
            t = min((c.time_created_ns or 0) for c in have.values())
            found.append(Found(div, sorted(culprits), t))
            break
    if not found:
        return None
    # Two groups can each miss a rank (rank 3 skipped group 2's all-reduce and waits in the
    # barrier; rank 2 waits in that all-reduce and so never reaches the barrier). Blame the
    # divergence whose absent rank went *past* the collective, not the one stuck before it.
    return min(found, key=lambda f: (_is_consequence(f, views), f.time_ns, f.div.seq))


def _is_consequence(f: Found, views: dict[int, RankView]) -> bool:
    """A missing rank that is still *behind* the others in program order did not skip
    anything: it is held up earlier, by another group's divergence."""
    if f.div.kind != "missing_rank" or not f.culprits or f.div.seq is None:
        return False
    culprit = f.culprits[0]
    if f.div.per_rank.get(culprit) is not None:
        return False  # it posted this collective (a tag mismatch): it is not held up earlier
    present = [r for r, c in f.div.per_rank.items() if c is not None]
    if not present:
        return False
    r_wait = present[0]
    waiting = views[r_wait].tl.by_pg.get(f.div.pg, {}).get(f.div.seq)
    absent = views[culprit].current
    if waiting is None or absent is None:
        return False
    return _who_skipped(waiting, absent, views, [r_wait], [culprit]) == "a"


def _skipped_by_tag(pg: str, seq: int, have: dict[int, Collective],
                    views: dict[int, RankView]) -> list[int] | None:
    """Same op and sizes, but the probe says they are different collectives (FSDP all-gathers
    of different experts have identical shapes and pair up silently). The rank that is
    *ahead* (its collective comes next on the others) skipped one: that is the culprit."""
    tags = {r: c.tag for r, c in have.items() if c.tag}
    if len(tags) < 2 or len(set(tags.values())) < 2:
        return None
    ahead = []
    for r, tag in tags.items():
        for q in tags:
            nxt = views[q].tl.by_pg.get(pg, {}).get(seq + 1)
            if q != r and nxt is not None and nxt.tag == tag and tags[q] != tag:
                ahead.append(r)
                break
    if ahead:
        return sorted(ahead)
    counts: dict[str, list[int]] = {}
    for r, tag in tags.items():
        counts.setdefault(tag, []).append(r)
    minority = _minority(list(counts.values()))
    return minority if minority is not None else sorted(tags)


def _minority(groups: list[list[int]]) -> list[int] | None:
    """Majority vote over groups of ranks that agree: the ranks outside the largest group when
    it is strictly bigger than every other, else None (no majority: blame is undecided)."""
    ranked = sorted(groups, key=len, reverse=True)
    if len(ranked) > 1 and len(ranked[0]) > len(ranked[1]):
        return sorted(r for rs in ranked[1:] for r in rs)
    return None


def _frames_in_backward(frames: list[Frame]) -> bool:
    from moe_hang.stacks import in_backward

    return in_backward(frames)


def _signature(c: Collective, kind: str) -> tuple:
    if kind == "op_mismatch":
        return (c.op,)
    if kind == "size_mismatch":
        return (c.op, tuple(map(tuple, c.input_sizes)))
    return (c.op, tuple(c.dtypes))


def _mismatch_kind(colls: list[Collective]) -> str | None:
    base = colls[0]
    if any(not _ops_match(base, c) for c in colls[1:]):
        return "op_mismatch"
    if base.op in SAME_SIZE_OPS and any(c.input_sizes != base.input_sizes for c in colls[1:]
                                        if c.input_sizes and base.input_sizes):
        return "size_mismatch"
    if any(c.dtypes and base.dtypes and c.dtypes != base.dtypes for c in colls[1:]):
        return "dtype_mismatch"
    return None


def _culprits(have: dict[int, Collective], views: dict[int, RankView]) -> list[int]:
    kind = _mismatch_kind(list(have.values())) or "op_mismatch"
    groups: list[tuple[Collective, list[int]]] = []
    for r, c in sorted(have.items()):
        for rep, rs in groups:
            same = _ops_match(rep, c) if kind == "op_mismatch" else (
                _signature(rep, kind) == _signature(c, kind))
            if same:
                rs.append(r)
                break
        else:
            groups.append((c, [r]))
    minority = _minority([rs for _, rs in groups])
    if minority is not None:
        return minority
    if kind == "op_mismatch" and len(groups) == 2:  # two groups of equal size
        (a, ra), (b, rb) = groups
        ahead = _who_skipped(a, b, views, ra, rb)
        if ahead is not None:
            return ra if ahead == "a" else rb
    return sorted(have)


def _site_key(c: Collective) -> tuple | None:
    site = callsite(c.frames) if c.frames else None
    if site is not None:
        return (site.file, site.line)
    return ("probe", c.name) if c.name else None


def _who_skipped(a: Collective, b: Collective, views: dict[int, RankView],
                 ra: list[int], rb: list[int]) -> str | None:
    """Which side posted a *later* collective in place of the other's, i.e. skipped one.

    First from history (in earlier iterations, did b's call site directly follow a's?), then
    from program order (at the deepest frame both stacks share, which line comes first?).
    """
    ka, kb = _site_key(a), _site_key(b)
    if ka and kb and ka != kb:
        a_then_b = b_then_a = False
        for v in views.values():
            keys = [_site_key(c) for c in sorted(v.tl.by_pg.get(a.pg, {}).values(),
                                                 key=lambda c: c.seq)]
            for k1, k2 in pairwise(keys):
                a_then_b |= (k1, k2) == (ka, kb)
                b_then_a |= (k1, k2) == (kb, ka)
        if a_then_b and not b_then_a:
            return "b"  # b's ranks went on to b's call site without posting a's
        if b_then_a and not a_then_b:
            return "a"
    fa = [f for f in reversed(a.frames) if not _lib(f)] if a.frames else []
    fb = [f for f in reversed(b.frames) if not _lib(f)] if b.frames else []
    if not fa:
        fa = _user_frames_outer_first(views[ra[0]])
    if not fb:
        fb = _user_frames_outer_first(views[rb[0]])
    first = _earlier_in_program(fa, fb)
    if first is None:
        return None
    return "b" if first == "a" else "a"  # the side whose line comes later skipped ahead


def _earlier_in_program(fa: list[Frame], fb: list[Frame]) -> str | None:
    """Which of two user stacks (outermost frame first) is earlier in program order: at the
    deepest frame they share, the one on the lower line ("a" or "b"; None: undecided)."""
    for x, y in zip(fa, fb, strict=False):
        if (x.file, x.function) != (y.file, y.function):
            return None
        if x.line != y.line:
            return "a" if x.line < y.line else "b"
    return None


def _lib(f: Frame) -> bool:
    from moe_hang.stacks import is_library_frame

    return is_library_frame(f)


def _user_frames_outer_first(v: RankView) -> list[Frame]:
    return [f for f in reversed(v.stack.frames) if not _lib(f)]


# ----------------------------------------------------------------------------- the verdict


def _fmt_sizes(c: RankCollective | Collective | None) -> str:
    if c is None:
        return "nothing"
    sizes = fmt_shape(c.input_sizes)
    text = f"{c.op}({sizes})" if sizes else c.op
    return f"{text} of {c.tag}" if c.tag else text


def _site_str(site: Frame | None) -> str:
    return f"{short_path(site.file)}:{site.line} {site.function}" if site else "unknown line"


def _tokens(ev: RankEvidence) -> dict | None:
    fwd = [r for r in ev.records if r.get("phase") == "forward" and r.get("tokens")]
    if not fwd:
        return None
    last = fwd[-1]
    tokens = dict(last["tokens"])
    lengths = next((r.get("lengths") for r in reversed(fwd) if r.get("lengths")), None)
    if lengths is not None:
        tokens["gathered_lengths"] = lengths
    assumed = next((r.get("assumed_lengths") for r in reversed(fwd)
                    if r.get("assumed_lengths")), None)
    if assumed is not None:
        # what DTensor.from_local(Shard(0)) believes every rank holds
        tokens["assumed_lengths"] = assumed
    if last.get("layer") is not None:
        tokens["layer"] = last["layer"]
    if last.get("step") is not None:
        tokens["step"] = last["step"]
    return tokens


def _report(v: RankView, div: Divergence | None) -> RankReport:
    ev = v.ev
    coll = v.current
    if coll is None and div is not None and div.per_rank.get(ev.rank) is not None:
        # nothing pending (it died): show its side of the divergence
        pick = v.tl.by_pg.get(div.pg, {}).get(div.seq) if div.seq is not None else None
        if pick is not None and v.state in ("in_collective", "exited"):
            coll = pick
    rc = _to_rc(coll, v)
    if rc is None and div is not None and div.per_rank.get(ev.rank) is not None:
        rc = div.per_rank[ev.rank]  # known from the stack only (coll is None here)
    if rc is None and v.state == "in_collective" and v.stack.op:
        rc = RankCollective(op=v.stack.op, pg="?", seq=None, source="stack")
    site = _posting_site(coll, v.stack, v.current, v.state) or v.site
    phase = coll.phase if coll is not None and coll.phase else None
    if phase is None and (v.stack.in_backward or (coll is not None and coll.frames
                                                  and _frames_in_backward(coll.frames))):
        phase = "backward"
    fn = coll.autograd_fn if coll is not None and coll.autograd_fn else v.stack.autograd_function
    if fn is None and coll is not None and coll.frames and _frames_in_backward(coll.frames):
        from moe_hang.stacks import autograd_function

        fn = autograd_function(coll.frames)
    note = None
    if ev.error:
        note = f"{ev.error.get('type', 'Error')}: {str(ev.error.get('message', ''))[:160]}"
    elif ev.stack_error:
        note = ev.stack_error
    elif ev.exit_code is not None and ev.exit_code != 0:
        note = _exit_desc(ev.exit_code)
    return RankReport(
        rank=ev.rank, pid=ev.pid, host=ev.host, state=v.state, collective=rc,
        callsite=_site_dict(site), tokens=_tokens(ev), exit_code=ev.exit_code,
        phase=phase, autograd_function=fn,
        stack=[f.short() for f in v.stack.frames[:40]], stack_source=ev.stack_source, note=note)


def fix_hint(div: Divergence | None, reports: dict[int, RankReport], verdict: str) -> str:
    if div is not None and div.kind == "size_mismatch":
        return ("Exchange per-rank lengths before gathering: all-gather the counts, pad to the "
                "max, all-gather, trim each piece (moe_hang.ep.VarlenDispatch); never infer "
                "the global shape as local × world (DTensor.from_local(Shard(0))) for ragged data.")
    if div is not None and div.kind in ("op_mismatch", "missing_rank"):
        if div.phase == "backward" or any(r.phase == "backward" for r in reports.values()):
            return ("A rank's autograd graph lacks a collective the others run in backward: tie "
                    "the output to every gathered input (y = y + x.sum() * 0, "
                    "moe_hang.ep.anchor_gradients) so every rank runs the same backward.")
        return ("Make every rank post every collective every step: do not skip a layer, expert "
                "or exchange when a rank has no tokens (run it on an empty or dummy input).")
    if div is not None and div.kind == "dtype_mismatch":
        return "Cast to one dtype on every rank before the collective."
    if verdict == "rank_died":
        return ("A rank died while the others wait in a collective: find why it died (OOM "
                "killer, signal, node failure); the survivors will only leave at the timeout.")
    if verdict == "crash":
        return "A rank raised an error; fix it first: the other ranks only fail as a consequence."
    if verdict == "straggler":
        return ("Not a deadlock: a rank is still computing while the others wait. Look at what "
                "it computes (stack below); raise the timeout or balance the work.")
    if verdict == "hang":
        return ("Every rank waits in the same collective with matching sizes, so the order is "
                "fine: suspect the transport (NCCL_DEBUG=INFO), a peer outside this job, or a "
                "device fault; Flight Recorder dumps from every rank would settle it.")
    return ""


def _site_dict(site: Frame | None) -> dict | None:
    return site.as_dict() if site is not None else None


def _stack_divergence(views: dict[int, RankView],
                      waiting: list[int]) -> tuple[Divergence, list[int]] | None:
    """Without recorder data: ranks blocked in *different* collectives can never complete."""
    ops: dict[int, str] = {r: op for r in waiting
                           if (op := views[r].stack.op) is not None and op != "unknown"}
    if len(set(ops.values())) < 2:
        return None
    groups: dict[str, list[int]] = {}
    for r, op in sorted(ops.items()):
        groups.setdefault(op, []).append(r)
    per_rank: dict[int, RankCollective | None] = {
        r: RankCollective(op=op, pg="?", seq=None, source="stack",
                          callsite=_site_dict(views[r].stack.callsite))
        for r, op in ops.items()}
    div = Divergence(pg="?", seq=None, kind="op_mismatch", members=sorted(ops),
                     per_rank=per_rank,
                     phase="backward" if any(views[r].stack.in_backward for r in ops) else None)
    # the group furthest behind in program order waits; the others went past it (skipped it)
    order = list(groups.items())
    behind = order[0]
    for cand in order[1:]:
        fa = _user_frames_outer_first(views[behind[1][0]])
        fb = _user_frames_outer_first(views[cand[1][0]])
        if _earlier_in_program(fa, fb) == "b":
            behind = cand
    culprits = [r for op, rs in groups.items() if op != behind[0] for r in rs]
    return div, culprits


def _size_abort_divergence(views: dict[int, RankView],
                           ev: Evidence) -> tuple[Divergence, list[int], str] | None:
    """gloo aborts the receiving rank when a peer sends more bytes than it expects ("Received
    data size doesn't match expected size"): a size mismatch, even where the aborted rank left
    no recorder dump. The survivors' entries name the group and sequence number."""
    abort = ev.size_abort
    if abort is None:
        return None
    aborted = [r for r, v in views.items()
               if v.ev.fatal or v.ev.exit_code == -signal.SIGABRT]
    if not aborted:
        return None
    ops = [views[r].stack.op for r in aborted if views[r].stack.op not in (None, "unknown")]
    op = ops[0] if ops else None
    found: dict[int, Collective] = {}
    for r, v in views.items():
        if r in aborted:
            continue
        same = [c for coll in v.tl.by_pg.values() for c in coll.values()
                if op is None or c.op == op]
        if same:
            found[r] = max(same, key=lambda c: (c.time_created_ns or 0, c.seq))
    ref = next(iter(found.values()), None)
    pg = ref.pg if ref else "?"
    seq = ref.seq if ref else None
    per_rank: dict[int, RankCollective | None] = {r: _to_rc(c, views[r])
                                                      for r, c in found.items()}
    for r in aborted:
        per_rank[r] = RankCollective(op=op or (ref.op if ref else "unknown"), pg=pg, seq=seq,
                                     source="stack",
                                     callsite=_site_dict(views[r].stack.callsite))
    detail = f"gloo aborted rank {_ranks(aborted)}"
    if abort.received is not None:
        detail += f": it received {abort.received} bytes where it expected {abort.expected}"
    div = Divergence(pg=pg, seq=seq, kind="size_mismatch", pg_desc=ref.pg_desc if ref else "",
                     members=sorted(per_rank), per_rank=per_rank, phase=ref.phase if ref else None)
    return div, sorted(per_rank), detail


def build_timeline(views: dict[int, RankView], div: Divergence | None,
                   before: int = 6, after: int = 2) -> dict | None:
    """Per-rank collectives of one group around the divergence (ranks × sequence numbers)."""
    pg = div.pg if div is not None and div.pg != "?" else DEFAULT_PG
    seqs = sorted({s for v in views.values() for s in v.tl.by_pg.get(pg, {})})
    if not seqs:
        return None
    focus = div.seq if div is not None and div.pg == pg and div.seq is not None else seqs[-1]
    window = [s for s in seqs if focus - before <= s <= focus + after]
    rows: dict[str, list[dict | None]] = {}
    for r, v in sorted(views.items()):
        cells: list[dict | None] = []
        for s in window:
            c = v.tl.by_pg.get(pg, {}).get(s)
            if c is None:
                cells.append(None)
            else:
                cells.append({"op": c.op, "sizes": c.input_sizes,
                              "state": "done" if c.completed else (
                                  "pending" if c.completed is False else "posted"),
                              "name": c.name})
        rows[str(r)] = cells
    desc = next((c.pg_desc for v in views.values() for c in v.tl.by_pg.get(pg, {}).values()
                 if c.pg_desc), "")
    return {"pg": pg, "pg_desc": desc, "seqs": window,
            "highlight": div.seq if div is not None and div.pg == pg else None, "ranks": rows}


def diagnose(ev: Evidence) -> Diagnosis:
    views = {r: rank_view(e) for r, e in sorted(ev.ranks.items())}
    found = align(views, ev.world_size)
    div = found.div if found else None
    culprits: list[int] = found.culprits if found else []
    evidence = list(ev.log_lines)
    for r, e in sorted(ev.ranks.items()):
        if e.fr_error:
            evidence.append(f"rank {r}: Flight Recorder dump unreadable ({e.fr_error})")
        if e.stack_error:
            evidence.append(f"rank {r}: {e.stack_error}")
        evidence.extend(f"rank {r}: {n}" for n in e.notes)

    exited = [r for r, v in views.items() if v.state == "exited"]
    bad_exit = [r for r in exited if ev.ranks[r].exit_code != 0 or ev.ranks[r].error]
    killed = [r for r in bad_exit if ev.ranks[r].exit_code == -signal.SIGKILL
              or (ev.ranks[r].exit_code is None and not ev.ranks[r].error
                  and not ev.ranks[r].fatal)]
    alive = [r for r in views if r not in exited]
    moving = [r for r in alive if views[r].ev.progressed
              or (views[r].state == "computing" and views[r].ev.progressed is not False)]
    waiting = [r for r in alive if views[r].state in ("in_collective", "idle")
               and r not in moving]
    stack_div = None
    abort_detail = ""
    if div is None and len(waiting) >= 2:
        stack_div = _stack_divergence(views, waiting)
        if stack_div is not None:
            div, culprits = stack_div
    if div is None and (size_abort := _size_abort_divergence(views, ev)) is not None:
        div, culprits, abort_detail = size_abort
    reports = {r: _report(v, div) for r, v in views.items()}

    def waits() -> str:
        victims = [r for r in views if r not in killed and reports[r].collective is not None
                   and (r in waiting or reports[r].state == "exited")]
        return ", ".join(f"rank {r} in {_fmt_sizes(reports[r].collective)}" for r in victims)

    agent_died = ev.agent_exit_code is not None and ev.agent_exit_code < 0 and bool(alive)
    orphans_moving = agent_died and any(views[r].ev.progressed for r in alive)
    if div is not None and agent_died and (
            orphans_moving or not all(views[r].state == "in_collective" for r in alive)):
        # orphans still stepping when captured: a snapshot of ranks in flight (one already in
        # the next collective) is not a desync
        div = None
        reports = {r: _report(v, None) for r, v in views.items()}
    if div is not None:
        verdict = "desync"
        summary = _desync_summary(div, reports, culprits, bad_exit, ev)
        if abort_detail:
            summary = summary.rstrip(".") + f" ({abort_detail})."
        if stack_div is not None:
            summary += (" (from stacks alone: Flight Recorder dumps, e.g. by running under "
                        "`moe-hang watch`, would name the group and sequence number)")
    elif agent_died:
        verdict, culprits = "crash", []
        w = waits()
        summary = (f"The launcher (torchrun agent) was {_exit_desc(ev.agent_exit_code)}; rank "
                   f"{_ranks(alive)} were left orphaned"
                   + (" and still running" if orphans_moving else "")
                   + (f" ({'when captured' if orphans_moving else 'blocked'}: {w})" if w else "")
                   + ". moe-hang ended them.")
    elif killed:
        verdict, culprits = "rank_died", killed
        w = waits()
        dead = ev.ranks[killed[0]]
        if said_exiting(dead.heartbeat):  # its interpreter shut down: it left, not killed
            how = "exited (its interpreter shut down normally) before the others"
        elif dead.exit_code is None:
            how = "is gone (no process) mid-step"
        else:
            how = f"died ({_exit_desc(dead.exit_code)}) mid-step"
        summary = (f"Rank {_ranks(killed)} {how}"
                   + (f" while {w} waited for it." if w else "."))
    elif bad_exit:
        verdict = "crash"
        culprits = [r for r in bad_exit if ev.ranks[r].error or ev.ranks[r].fatal]
        if not culprits and ev.root_cause_rank in bad_exit:
            culprits = [ev.root_cause_rank]
        if not culprits:  # the ranks torchrun ended with SIGTERM are the victims
            culprits = [r for r in bad_exit if ev.ranks[r].exit_code != -signal.SIGTERM] \
                or bad_exit
        first = culprits[0]
        what = reports[first].note or _exit_desc(ev.ranks[first].exit_code)
        summary = f"Rank {_ranks(culprits)} crashed: {what}."
    elif ev.job == "completed" or (exited and not alive):
        verdict, culprits = "healthy", []
        summary = f"All {len(views)} ranks finished; every collective matched."
    elif alive and len(moving) == len(alive):
        verdict, culprits = "healthy", []
        summary = (f"All {len(alive)} ranks are making progress (their stacks moved between "
                   "two samples): no hang right now.")
    elif waiting and moving:
        verdict = "straggler"
        culprits = sorted(moving)
        summary = (f"Rank {_ranks(culprits)} is still computing while rank {_ranks(waiting)} "
                   "wait in a collective: slow, not deadlocked.")
    elif (in_coll := [r for r in waiting if views[r].state == "in_collective"]) and \
            len(in_coll) < len(waiting):
        verdict = "hang"
        culprits = sorted(set(waiting) - set(in_coll))
        where = "; ".join(f"rank {r} at {_site_str(views[r].site)}" for r in culprits)
        summary = (f"Rank {_ranks(culprits)} is blocked outside any collective ({where}) "
                   f"while {waits()} waits for it.")
    elif waiting and len(waiting) == len(alive):
        ops = {c.op if (c := reports[r].collective) else (views[r].stack.op or "?")
               for r in waiting}
        verdict, culprits = "hang", []
        op = ops.pop() if len(ops) == 1 else "collectives"
        summary = (f"All {len(waiting)} ranks wait in {op} with matching order and sizes: the "
                   "collective order is consistent, so the cause is outside it.")
    else:
        verdict = "inconclusive"
        culprits = []
        known = [r for r, v in views.items() if v.state != "unknown"]
        summary = ("Not enough evidence to name a cause: "
                   + (f"states known for rank {_ranks(known)} only." if known
                      else "no stack or recorder data could be read."))
    return Diagnosis(
        verdict=verdict, summary=summary, culprit_ranks=sorted(culprits), first_divergence=div,
        ranks=list(reports.values()), fix=fix_hint(div, reports, verdict),
        artifacts=ev.artifacts, evidence=evidence, timeline=build_timeline(views, div))


def _ranks(rs: list[int]) -> str:
    rs = sorted(rs)
    if not rs:
        return "-"
    if len(rs) == 1:
        return str(rs[0])
    return ", ".join(map(str, rs[:-1])) + f" and {rs[-1]}"


def _desync_summary(div: Divergence, reports: dict[int, RankReport], culprits: list[int],
                    bad_exit: list[int], ev: Evidence) -> str:
    where = " in backward" if div.phase == "backward" else ""
    callsites = {r: cs for r in div.per_rank if r in reports and (cs := reports[r].callsite)}
    same_site = len({(cs["file"], cs["line"]) for cs in callsites.values()}) == 1

    def at(cs: dict) -> str:
        return f"{short_path(str(cs.get('file')))}:{cs.get('line')} {cs.get('function')}"

    parts = []
    for r, c in sorted(div.per_rank.items()):
        if c is None:
            parts.append(f"rank {r} never posted it")
            continue
        text = f"rank {r} {_fmt_sizes(c)}"
        if not same_site and r in callsites:
            text += f" at {at(callsites[r])}"
        parts.append(text)
    site = f" at {at(next(iter(callsites.values())))}" if same_site and callsites else ""
    tail = ""
    if bad_exit:
        tail = "; " + ", ".join(f"rank {r} {_exit_desc(ev.ranks[r].exit_code)}"
                                for r in bad_exit[:4])
    if div.seq is None:
        return f"Ranks wait in different collectives{where}{site}: " + "; ".join(parts) + tail \
            + "."
    pg_name = pg_label(div.pg, div.pg_desc)
    tags = {r: c.tag for r, c in div.per_rank.items() if c is not None and c.tag}
    if div.kind == "missing_rank" and len(set(tags.values())) > 1:
        ahead = [r for r in culprits if r in tags]
        behind = [r for r in tags if r not in ahead]
        if ahead and behind:
            skipped, posted = tags[behind[0]], tags[ahead[0]]
            first_ahead = div.per_rank.get(ahead[0])
            op = first_ahead.op if first_ahead is not None else "collective"
            return (f"Rank {_ranks(ahead)} never posted the {op} of {skipped}: at seq "
                    f"{div.seq} of {pg_name} its {op} of {posted} paired with rank "
                    f"{_ranks(behind)}'s {op} of {skipped} (same size, so silently), and every "
                    "later collective paired with the wrong partner" + tail + ".")
    pg = pg_name
    if div.pg != DEFAULT_PG and div.members:
        pg += f" (ranks {', '.join(map(str, div.members))})"
    kind = {"size_mismatch": "different sizes", "op_mismatch": "different collectives",
            "dtype_mismatch": "different dtypes",
            "missing_rank": "a collective some ranks never reached"}[div.kind]
    return (f"Ranks posted {kind} at seq {div.seq} of {pg}{where}{site}: "
            + "; ".join(parts) + tail + ".")


def quick_divergence(heartbeats: dict[int, dict], world: int | None) -> Divergence | None:
    """From heartbeats alone: ranks pending at the same seq with a different op, size or
    dtype can never complete, so there is no need to wait for a stall timeout."""
    views = {r: rank_view(RankEvidence(rank=r, pid=hb.get("pid"), heartbeat=hb, alive=True,
                                       progressed=False))
             for r, hb in heartbeats.items()}
    found = align(views, world)
    if found is None or found.div.kind == "missing_rank":
        return None
    return found.div
