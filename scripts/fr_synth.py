"""Synthesize Flight Recorder dump sets in torch's own format, with one planted fault.

    python scripts/fr_synth.py OUT_DIR --ranks N --entries E [--mesh DPxTP] --fault KIND
        [--format pickle|json] [--backend nccl|gloo] [--version V] [--seed S] [--frames]
        [--timing] [--p2p] [--prefix P] [--workers W]
    python scripts/fr_synth.py --check-against REAL_DIR SYNTH_DIR   # compare schemas

Writes one dump per rank, named prefix + global rank (``.json`` appended for JSON), exactly as
torch's recorder of that release and backend lays it out (see docs/flight_recorder_formats.md), and
``OUT_DIR/truth.json`` with the planted fault (a name no reader that globs prefix + rank picks up:
it holds neither the prefix nor a trailing rank number).

The job modelled: a 2-D DeviceMesh ``(dp, tp)`` = ``--mesh`` (rank = dp_index * tp + tp_index),
made with ``init_device_mesh(..., mesh_dim_names=("dp", "tp"))`` on the ``new_group`` path: the
default group "0" (desc ``default_pg``), then one ``mesh_dp`` group per mesh column (names "1" ..
str(tp)), then one ``mesh_tp`` group per mesh row (names str(tp + 1) ...). Every rank runs the same
training step (FSDP-style all-gather / reduce-scatter on dp, tensor-parallel all-reduce on tp, a
grad-norm and a loss all-reduce on the default group; with ``--p2p`` or ``--fault p2p`` also an
activation send/recv between dp neighbours), for thousands of steps, so the ring buffer has wrapped
and ``record_id``/sequence numbers continue from large counts. The last step carries the fault.

Backends differ the way torch does: NCCL enqueues asynchronously (every rank posts the whole last
step up to its CPU sync, the loss ``.item()``; entries then complete in stream order), gloo blocks
in each collective (a rank's dump ends at the collective it waits in; no send/recv entries, only
``op_id`` gaps; entries stay ``scheduled`` and only ``retired`` tells completion; pg_status counts
ops and may lag; ``pg_config`` is the single ``''`` entry).

Fault kinds: missing_rank, size, dtype, op, order, p2p, none.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import pickle
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

FAULTS = ("missing_rank", "size", "dtype", "op", "order", "p2p", "none")
RELEASES = ("2.4", "2.5", "2.6", "2.7", "2.8", "2.9", "2.10", "2.11", "2.12", "2.13")
TRUTH_NAME = "truth.json"


# ----------------------------------------------------------------------------- format per release


@dataclass(frozen=True)
class Schema:
    release: str
    version_val: str  # what the dump's "version" says
    lib_version_key: str | None  # "nccl_version" (2.8), "comm_lib_version" (2.9+), None before
    has_pg_status: bool
    has_timeout: bool
    has_thread: bool
    has_json: bool
    prefix: str  # basename of torch's default dump-file prefix


def schema_for(release: str) -> Schema:
    minor = int(release.split(".")[1])
    if minor == 4:  # TraceUtils.h NCCLTraceBuffer (2.4)
        return Schema(release, "2.1", None, False, False, False, False, "nccl_trace_rank_")
    if minor <= 7:  # NCCLUtils (2.5) / FlightRecorder.cpp (2.6, 2.7), NCCL only
        return Schema(release, "2.4", None, True, True, False, True, "nccl_trace_rank_")
    if minor == 8:  # FlightRecorderDetail.hpp template, NCCL and gloo
        return Schema(release, "2.9", "nccl_version", True, True, True, True, "nccl_trace_rank_")
    return Schema(release, "2.10", "comm_lib_version", True, True, True, True,
                  "comm_lib_trace_rank_")


def entry_keys(s: Schema) -> list[str]:
    """Insertion order of an entry dict in the pickle (getCollectiveTrace); duration_ms is
    inserted after time_created_ns when present, frames first when stacks are included."""
    keys = ["record_id", "pg_id", "process_group"]
    if s.has_thread:
        keys += ["thread_name", "thread_id"]
    keys += ["collective_seq_id", "p2p_seq_id", "op_id", "profiling_name", "time_created_ns",
             "input_sizes", "input_dtypes", "output_sizes", "output_dtypes", "state",
             "time_discovered_started_ns", "time_discovered_completed_ns", "retired"]
    if s.has_timeout:
        keys.append("timeout_ms")
    keys.append("is_p2p")
    return keys


# ----------------------------------------------------------------------------- the job model


@dataclass(frozen=True)
class OpT:
    """One op of the step template, on a rank."""

    group: str  # "world" | "dp" | "tp"
    kind: str  # all_reduce | all_gather | reduce_scatter | send | recv
    in_sizes: tuple[tuple[int, ...], ...]
    out_sizes: tuple[tuple[int, ...], ...]
    dtype: str
    site: str  # the model code that posts it (for frames)
    peer: int = -1  # p2p: the global peer rank
    name_override: str = ""  # fault "op": the op the culprit posts instead

    @property
    def p2p(self) -> bool:
        return self.kind in ("send", "recv")


@dataclass
class Job:
    ranks: int
    dp: int
    tp: int
    backend: str
    schema: Schema
    fmt: str
    entries: int
    seed: int
    frames: bool
    timing: bool
    p2p: bool
    prefix: str
    fault: str
    steps_before: int = 0
    t0_ns: int = 0
    # filled by plan(): per-rank final-step ops and how far each rank's stream got
    culprits: list[int] = field(default_factory=list)
    fault_index: int = -1  # index in the template of the faulted op
    fault_group: str = ""
    swap_index: int = -1  # "order": the op the culprit posts first (template index)
    p2p_victim: int = -1


LAYERS = 2
HIDDEN = (8, 1024, 4096)
PARAMS = 16_777_216


def template(job: Job, rank: int) -> list[OpT]:
    """The training step as one rank posts it (NCCL op names are mapped later)."""
    dp, tp = job.dp, job.tp
    shard = PARAMS // dp
    act = (HIDDEN,)
    ops: list[OpT] = []
    for layer in range(LAYERS):
        ops.append(OpT("dp", "all_gather", ((shard,),), ((shard * dp,),), "BFloat16",
                       f"fsdp.unshard layers.{layer}"))
        ops.append(OpT("tp", "all_reduce", act, act, "BFloat16",
                       f"RowParallelLinear.forward layers.{layer}.mlp.down_proj"))
    if job.p2p:
        dpi = rank // tp
        if dpi % 2 == 0 and dpi + 1 < dp:
            ops.append(OpT("world", "send", act, act, "BFloat16", "pipeline.send_activations",
                           peer=rank + tp))
        elif dpi % 2 == 1:
            ops.append(OpT("world", "recv", act, act, "BFloat16", "pipeline.recv_activations",
                           peer=rank - tp))
    for layer in reversed(range(LAYERS)):
        ops.append(OpT("tp", "all_reduce", act, act, "BFloat16",
                       f"ColumnParallelLinear.backward layers.{layer}.mlp.up_proj"))
        ops.append(OpT("dp", "all_gather", ((shard,),), ((shard * dp,),), "BFloat16",
                       f"fsdp.unshard (backward) layers.{layer}"))
        ops.append(OpT("dp", "reduce_scatter", ((PARAMS,),), ((shard,),), "Float",
                       f"fsdp.reduce_grads layers.{layer}"))
    ops.append(OpT("world", "all_reduce", ((1,),), ((1,),), "Float", "clip_grad_norm_"))
    ops.append(OpT("world", "all_reduce", ((1,),), ((1,),), "Float", "loss.item (logging)"))
    return ops


@dataclass(frozen=True)
class GroupInfo:
    name: str
    desc: str
    pg_id: int
    size: int
    local_rank: int
    first: int  # global ranks: first, first + stride, ...
    stride: int

    def members(self) -> list[int]:
        return list(range(self.first, self.first + self.stride * self.size, self.stride))

    def local_of(self, global_rank: int) -> int:
        return (global_rank - self.first) // self.stride


def group_of(job: Job, rank: int, g: str) -> GroupInfo:
    """The group ``g`` ("world" | "dp" | "tp") that ``rank`` belongs to."""
    tp = job.tp
    if g == "world":
        return GroupInfo("0", "default_pg", 0, job.ranks, rank, 0, 1)
    if g == "dp":
        t = rank % tp
        return GroupInfo(str(1 + t), "mesh_dp", 1, job.dp, rank // tp, t, tp)
    d = rank // tp
    return GroupInfo(str(1 + tp + d), "mesh_tp", 2, tp, rank % tp, d * tp, 1)


def plan(job: Job) -> None:
    """Choose the culprit and the faulted op of the last step (deterministic by seed)."""
    rng = random.Random(job.seed)
    job.steps_before = rng.randint(3000, 9000)
    job.t0_ns = 1_790_000_000_000_000_000 + rng.randint(0, 10**15)
    if job.fault == "none":
        return
    tmpl = template(job, 0)
    if job.fault == "p2p":
        senders = [r for r in range(job.ranks) if any(o.kind == "send" for o in template(job, r))]
        c = rng.choice(senders)
        job.culprits = [c]
        job.fault_index = next(i for i, o in enumerate(template(job, c)) if o.kind == "send")
        job.fault_group = "world"
        job.p2p_victim = c + job.tp
        return
    c = rng.randrange(job.ranks)
    job.culprits = [c]
    if job.fault == "order":
        # the culprit posts the grad-norm all-reduce (default group) before its last dp
        # reduce-scatter; everyone else does the reduce-scatter first: a cycle across groups
        i_rs = max(i for i, o in enumerate(tmpl) if o.kind == "reduce_scatter")
        job.fault_index, job.swap_index, job.fault_group = i_rs, i_rs + 1, "dp"
        return
    if job.fault == "missing_rank":
        g = rng.choice(["tp", "dp"])
        job.fault_group = g
        job.fault_index = max(i for i, o in enumerate(tmpl) if o.group == g)
        return
    cands = [i for i, o in enumerate(tmpl) if o.group in ("tp", "dp") and not o.p2p]
    job.fault_index = rng.choice(cands[: len(cands) // 2 + 1])
    job.fault_group = tmpl[job.fault_index].group


def final_step(job: Job, rank: int) -> list[OpT]:
    ops = template(job, rank)
    if rank not in job.culprits or job.fault == "none":
        return ops
    i = job.fault_index
    o = ops[i]
    if job.fault in ("missing_rank", "p2p"):
        return ops[:i] + ops[i + 1:]
    if job.fault == "order":
        ops[i], ops[job.swap_index] = ops[job.swap_index], ops[i]
        return ops
    if job.fault == "size":
        ins = tuple((s[0] + 1, *s[1:]) for s in o.in_sizes)
        outs = tuple((s[0] + 1, *s[1:]) for s in o.out_sizes)
        ops[i] = replace(o, in_sizes=ins, out_sizes=outs)
    elif job.fault == "dtype":
        ops[i] = replace(o, dtype="Float" if o.dtype != "Float" else "BFloat16")
    elif job.fault == "op":
        ops[i] = replace(o, name_override=_other_op(job.backend, o.kind))
    return ops


def _other_op(backend: str, kind: str) -> str:
    """The op the culprit of an "op" fault posts instead of ``kind``: one the recorder names
    differently. gloo records a reduce_scatter as ``gloo:all_reduce`` (and would run it
    against an all_reduce of the same buffer), so there the swap is with an all_gather."""
    if backend == "gloo":
        return "all_reduce" if kind == "all_gather" else "all_gather"
    return "reduce_scatter" if kind != "reduce_scatter" else "all_reduce"


def simulate(job: Job) -> tuple[list[int], list[list[OpT]]]:
    """How far each rank's stream gets in the last step: head[r] = index of the first op of
    ``finals[r]`` that never completes (len when all complete). A collective instance (group,
    seq) completes when every member's stream is at it and no member posted a different op,
    size or dtype; a send completes with the matching recv."""
    finals = [final_step(job, r) for r in range(job.ranks)]
    keys: list[list[tuple[Any, ...]]] = []
    sigs: dict[tuple[Any, ...], set[tuple[Any, ...]]] = {}
    for r, ops in enumerate(finals):
        seq: Counter[str] = Counter()
        chan: Counter[tuple[int, int]] = Counter()
        ks = []
        for o in ops:
            if o.p2p:
                a, b = (r, o.peer) if o.kind == "send" else (o.peer, r)
                chan[(a, b)] += 1
                k: tuple[Any, ...] = ("p2p", a, b, chan[(a, b)])
            else:
                name = group_of(job, r, o.group).name
                seq[name] += 1
                k = ("c", name, seq[name])
                sigs.setdefault(k, set()).add(
                    (o.name_override or o.kind, o.in_sizes, o.out_sizes, o.dtype))
            ks.append(k)
        keys.append(ks)
    size_of = {"world": job.ranks, "dp": job.dp, "tp": job.tp}
    head = [0] * job.ranks
    while True:
        at: Counter[tuple[Any, ...]] = Counter()
        for r in range(job.ranks):
            if head[r] < len(keys[r]):
                at[keys[r][head[r]]] += 1
        done = set()
        for k, n in at.items():
            if k[0] == "p2p":
                if n == 2:
                    done.add(k)
            elif len(sigs[k]) == 1:
                g = "world" if k[1] == "0" else ("dp" if int(k[1]) <= job.tp else "tp")
                if n == size_of[g]:
                    done.add(k)
        if not done:
            break
        for r in range(job.ranks):
            if head[r] < len(keys[r]) and keys[r][head[r]] in done:
                head[r] += 1
    return head, finals


# ----------------------------------------------------------------------------- writing dumps


def profiling_name(backend: str, o: OpT, local_rank: int, local_peer: int) -> str:
    kind = o.name_override or o.kind
    if backend == "gloo":  # all_gather_into_tensor shows as all_gather, reduce_scatter as
        # all_reduce
        return "gloo:" + {"reduce_scatter": "all_reduce"}.get(kind, kind)
    if kind == "send":
        return f"nccl:send {local_rank}->{local_peer}"
    if kind == "recv":
        return f"nccl:recv {local_rank}<-{local_peer}"
    return "nccl:" + {"all_gather": "_all_gather_base",
                      "reduce_scatter": "_reduce_scatter_base"}.get(kind, kind)


def gloo_sizes(o: OpT, group_size: int) -> tuple[list[list[int]], list[list[int]]]:
    """gloo records all_gather_into_tensor's output as [world, *input] and a reduce_scatter as
    the all_reduce of its whole input (measured on torch 2.13, tests/unit/fixtures/fr_real)."""
    ins = [list(s) for s in o.in_sizes]
    kind = o.name_override or o.kind
    if kind == "all_gather":
        return ins, [[group_size, *s] for s in o.in_sizes]
    if kind == "reduce_scatter":
        return ins, [list(s) for s in o.in_sizes]
    return ins, [list(s) for s in o.out_sizes]


_FRAME_CACHE: dict[str, list[dict[str, Any]]] = {}
_C10D = "/usr/local/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py"
_LOGGER = "/usr/local/lib/python3.11/site-packages/torch/distributed/c10d_logger.py"
_API_LINE = {"all_reduce": ("all_reduce", 3245), "all_gather": ("all_gather_single", 4387),
             "reduce_scatter": ("reduce_scatter_single", 4878), "send": ("send", 2692),
             "recv": ("recv", 2747), "broadcast": ("broadcast", 3130)}


def frames_for(o: OpT) -> list[dict[str, Any]]:
    """A plausible innermost-first Python stack for the op (shared objects: pickle memoizes)."""
    key = f"{o.name_override or o.kind}|{o.site}"
    if key not in _FRAME_CACHE:
        fn, line = _API_LINE.get(o.name_override or o.kind, ("all_reduce", 3245))
        site = o.site.split(" ")[0]
        mod = site.split(".")[0].lower()
        h = sum(map(ord, o.site))
        _FRAME_CACHE[key] = [
            {"name": fn, "filename": _C10D, "line": line},
            {"name": "wrapper", "filename": _LOGGER, "line": 83},
            {"name": site.split(".")[-1], "filename": f"/workspace/model/{mod}.py",
             "line": 40 + h % 400},
            {"name": "train_step", "filename": "/workspace/train.py", "line": 212},
            {"name": "main", "filename": "/workspace/train.py", "line": 301},
            {"name": "<module>", "filename": "/workspace/train.py", "line": 340},
        ]
    return _FRAME_CACHE[key]


def _mix(*xs: int) -> int:
    h = 1469598103934665603
    for x in xs:
        h = ((h ^ (x & 0xFFFFFFFFFFFFFFFF)) * 1099511628211) & 0xFFFFFFFFFFFFFFFF
    return h


_WORLD_RANKS_STR: dict[int, str] = {}


def ranks_str(ranks: list[int]) -> str:
    return "[" + ", ".join(map(str, ranks)) + "]"


def build_dump(job: Job, rank: int, head: int, final: list[OpT]) -> dict[str, Any]:
    """One rank's dump as torch's recorder returns it (pickle object layout)."""
    s = job.schema
    gloo = job.backend == "gloo"
    tmpl = template(job, rank)
    groups = {g: group_of(job, rank, g) for g in ("world", "dp", "tp")}
    per_step_c: Counter[str] = Counter(o.group for o in tmpl if not o.p2p)
    per_step_p: Counter[str] = Counter(o.group for o in tmpl if o.p2p)
    per_step_ops: Counter[str] = Counter(o.group for o in tmpl)
    recorded = [o for o in tmpl if not (gloo and o.p2p)]
    nb = job.steps_before
    cseq = {g: nb * per_step_c[g] for g in groups}
    pseq = {g: nb * per_step_p[g] for g in groups}
    opid = {g: nb * per_step_ops[g] for g in groups}
    rec = nb * len(recorded)
    # posted ops of the last step: NCCL posts all (async, up to the loss .item() sync); gloo
    # blocks in the first op that does not complete
    posted = final if not gloo else final[: head + 1]
    n_window = math.ceil(job.entries / max(1, len(recorded))) + 1
    steps: list[tuple[int, list[OpT], int]] = [(nb + i, tmpl, len(tmpl)) for i in range(n_window)]
    steps.append((nb + n_window, posted, head))
    timeout = 1_800_000 if gloo else 600_000
    thread_id = str(139_600_000_000_000 + (_mix(job.seed, rank) % 10**12) // 64 * 64)
    jitter = _mix(job.seed, rank, 7) % 900_000
    pg_names = {g: (groups[g].name, groups[g].desc) for g in groups}
    last_enq: dict[str, int] = {}
    last_done: dict[str, int] = {}
    last_start: dict[str, int] = {}
    out: list[dict[str, Any]] = []
    keys = entry_keys(s)
    n_recorded = n_window * len(recorded) + sum(1 for o in posted if not (gloo and o.p2p))
    skip = n_recorded - job.entries  # ring buffer: the oldest ones were overwritten
    seen = 0
    for step, ops, complete_upto in steps:
        t_step = job.t0_ns + step * 1_500_000_000
        for j, o in enumerate(ops):
            g = o.group
            opid[g] += 1
            if o.p2p:
                pseq[g] += 1
            else:
                cseq[g] += 1
                # gloo's pg_status counts ops (p2p included); NCCL's counts collectives
                last_enq[g] = opid[g] if gloo else cseq[g]
            done = j < complete_upto
            if done and not o.p2p:
                last_done[g] = opid[g] if gloo else cseq[g]
            if j <= complete_upto and not o.p2p and job.timing and not gloo:
                last_start[g] = cseq[g]  # the stuck op has started: its kernel waits for peers
            if gloo and o.p2p:
                continue  # gloo records no send/recv entry
            seen += 1
            if seen <= skip:
                rec += 1
                continue
            t = t_step + j * 41_000_000 + jitter
            started = (t + 90_000) if (job.timing and (done or j == complete_upto)
                                       and not gloo) else None
            completed = (t + 2_400_000 + (jitter % 50_000)) if (done and not gloo) else None
            if gloo:
                ins, outs = gloo_sizes(o, groups[g].size)
            else:
                ins = [list(x) for x in o.in_sizes]
                outs = [list(x) for x in o.out_sizes]
            peer_local = groups[g].local_of(o.peer) if o.p2p else -1
            vals: dict[str, Any] = {
                "record_id": rec, "pg_id": groups[g].pg_id, "process_group": pg_names[g],
                "thread_name": "python", "thread_id": thread_id,
                "collective_seq_id": cseq[g], "p2p_seq_id": pseq[g], "op_id": opid[g],
                "profiling_name": profiling_name(job.backend, o, groups[g].local_rank,
                                                 peer_local),
                "time_created_ns": t, "input_sizes": ins,
                "input_dtypes": [o.dtype] * len(ins), "output_sizes": outs,
                "output_dtypes": [o.dtype] * len(outs),
                "state": "completed" if completed else ("started" if started else "scheduled"),
                "time_discovered_started_ns": started,
                "time_discovered_completed_ns": completed,
                "retired": done, "timeout_ms": timeout, "is_p2p": o.p2p,
            }
            if job.frames and job.fmt == "pickle":
                e: dict[str, Any] = {"frames": frames_for(o)}
                e.update((k, vals[k]) for k in keys)
            else:
                e = {k: vals[k] for k in keys}
            if job.timing and completed and not gloo:  # inserted after time_created_ns
                items = list(e.items())
                at = keys.index("time_created_ns") + 1 + ("frames" in e)
                items.insert(at, ("duration_ms", 2.3 + (jitter % 1000) / 1000))
                e = dict(items)
            out.append(e)
            rec += 1
    entries = out[-job.entries:]
    dump: dict[str, Any] = {"version": s.version_val}
    # pg_config: std::map keyed (name, desc), so names sort as strings
    if gloo:
        dump["pg_config"] = {"": {"name": "", "desc": "", "ranks": "[]"}}
    else:
        cfg = {}
        for g in sorted(groups, key=lambda g: groups[g].name):
            gi = groups[g]
            if g == "world":
                if job.ranks not in _WORLD_RANKS_STR:
                    _WORLD_RANKS_STR[job.ranks] = ranks_str(gi.members())
                rs = _WORLD_RANKS_STR[job.ranks]
            else:
                rs = ranks_str(gi.members())
            cfg[gi.name] = {"name": gi.name, "desc": gi.desc, "ranks": rs}
        dump["pg_config"] = cfg
    if s.lib_version_key:
        dump[s.lib_version_key] = "" if gloo else ("2.26.2" if s.release == "2.8" else "2.27.5")
    if s.has_pg_status:
        status = {}
        for g in sorted(groups, key=lambda g: groups[g].pg_id):
            enq = last_enq.get(g, -1)
            comp = last_done.get(g, -1)
            if gloo and comp >= 0 and enq > comp + 1 and _mix(job.seed, rank, 11) % 4 == 0:
                comp = max(-1, comp - 1 - _mix(job.seed, rank, 12) % 3)  # gloo lags (measured)
            started = last_start.get(g, -1)
            status[str(groups[g].pg_id)] = {"last_enqueued_collective": enq,
                                         "last_started_collective": started,
                                         "last_completed_collective": comp}
        dump["pg_status"] = status
    dump["entries"] = entries
    return dump


def to_json(dump: dict[str, Any]) -> str:
    """dump_json(): nlohmann objects (sorted keys, compact), pg_status values as strings,
    missing times as 0, no frames, no "entries" when empty, nccl_comm_state {}."""
    j = dict(dump)
    if "pg_status" in j:
        j["pg_status"] = {k: {kk: str(vv) for kk, vv in v.items()}
                          for k, v in j["pg_status"].items()}
    ents = []
    for e in dump["entries"]:
        e2 = {k: v for k, v in e.items() if k != "frames"}
        e2["process_group"] = list(e2["process_group"])
        for k in ("time_discovered_started_ns", "time_discovered_completed_ns"):
            if e2[k] is None:
                e2[k] = 0
        ents.append(e2)
    if ents:
        j["entries"] = ents
    else:
        j.pop("entries", None)
    j["nccl_comm_state"] = {}
    return json.dumps(j, sort_keys=True, separators=(",", ":"))


_JOB: Job | None = None
_HEADS: list[int] = []
_FINALS: list[list[OpT]] = []


def _init_worker(job: Job, heads: list[int], finals: list[list[OpT]]) -> None:
    global _JOB, _HEADS, _FINALS
    _JOB, _HEADS, _FINALS = job, heads, finals


def _write_ranks(args: tuple[Path, list[int]]) -> int:
    out, ranks = args
    job = _JOB
    assert job is not None
    n = 0
    for r in ranks:
        dump = build_dump(job, r, _HEADS[r], _FINALS[r])
        if job.fmt == "json":
            path = out / f"{job.prefix}{r}.json"
            path.write_text(to_json(dump))
        else:
            path = out / f"{job.prefix}{r}"
            with path.open("wb") as f:
                pickle.dump(dump, f, protocol=2)
        n += 1
    return n


def write_truth(job: Job, out: Path, heads: list[int], finals: list[list[OpT]]) -> dict[str, Any]:
    truth: dict[str, Any] = {
        "generator": "scripts/fr_synth.py", "fault": job.fault, "ranks": job.ranks,
        "entries": job.entries, "mesh": [job.dp, job.tp], "mesh_dim_names": ["dp", "tp"],
        "backend": job.backend, "torch_release": job.schema.release,
        "format_version": job.schema.version_val, "format": job.fmt, "seed": job.seed,
        "frames": job.frames and job.fmt == "pickle", "timing": job.timing, "prefix": job.prefix,
        "files": f"{job.prefix}<rank>{'.json' if job.fmt == 'json' else ''}",
        "culprits": job.culprits,
    }
    stuck = [r for r in range(job.ranks) if heads[r] < len(finals[r])]
    truth["hung"] = bool(stuck)
    truth["stuck_ranks"] = len(stuck)
    if job.fault != "none":
        c = job.culprits[0]
        tmpl = template(job, c)
        o = tmpl[job.fault_index]
        gi = group_of(job, c, job.fault_group)
        members = gi.members()
        n_c = sum(1 for x in tmpl if x.group == job.fault_group and not x.p2p)
        n_p = sum(1 for x in tmpl if x.group == job.fault_group and x.p2p)
        idx_c = sum(1 for x in tmpl[: job.fault_index + 1]
                    if x.group == job.fault_group and not x.p2p)
        idx_p = sum(1 for x in tmpl[: job.fault_index + 1] if x.group == job.fault_group and x.p2p)
        last_step = job.steps_before + math.ceil(
            job.entries / max(1, len([x for x in tmpl if not (job.backend == "gloo" and x.p2p)]))
        ) + 1
        truth["group"] = {"name": gi.name, "desc": gi.desc, "pg_id": gi.pg_id,
                          "size": len(members),
                          "ranks": members if len(members) <= 256 else
                          f"{members[0]}..{members[-1]} step {members[1] - members[0]}"}
        cseq = last_step * n_c + idx_c
        if o.p2p:
            pseq = last_step * n_p + idx_p
            truth.update({"seq": pseq, "seq_field": "p2p_seq_id", "collective_seq_id_at": cseq,
                          "victims": [job.p2p_victim],
                          "expected_op": profiling_name(job.backend, o, c, job.p2p_victim),
                          "victim_op": profiling_name(job.backend, replace(o, kind="recv"),
                                                      job.p2p_victim, c),
                          "culprit_op": None,
                          "note": "the culprit never posted this send; its peer waits in recv"
                          + (" (gloo records neither)" if job.backend == "gloo" else "")})
        else:
            truth.update({"seq": cseq, "seq_field": "collective_seq_id",
                          "expected_op": profiling_name(job.backend, o, 0, 0),
                          "expected_input_sizes": [list(x) for x in o.in_sizes],
                          "expected_dtype": o.dtype})
            f = final_step(job, c)
            if job.fault == "missing_rank":
                truth["culprit_op"] = None
                truth["note"] = "the culprit never enqueued this collective"
            elif job.fault == "order":
                o2 = tmpl[job.swap_index]
                g2 = group_of(job, c, o2.group)
                n_c2 = sum(1 for x in tmpl if x.group == o2.group and not x.p2p)
                idx2 = sum(1 for x in tmpl[: job.swap_index + 1]
                           if x.group == o2.group and not x.p2p)
                truth["second_group"] = {"name": g2.name, "desc": g2.desc, "pg_id": g2.pg_id,
                                         "seq": last_step * n_c2 + idx2,
                                         "op": profiling_name(job.backend, o2, 0, 0)}
                truth["culprit_op"] = profiling_name(job.backend, f[job.fault_index], 0, 0)
                truth["note"] = ("the culprit posts the second group's collective before the "
                                 "first; the others do first then second: a wait-for cycle")
            else:
                fo = f[job.fault_index]
                truth["culprit_op"] = profiling_name(job.backend, fo, 0, 0)
                truth["culprit_input_sizes"] = [list(x) for x in fo.in_sizes]
                truth["culprit_dtype"] = fo.dtype
    (out / TRUTH_NAME).write_text(json.dumps(truth, indent=1) + "\n")
    return truth


def generate(job: Job, out: Path, workers: int) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    for p in out.glob(f"{job.prefix}*"):
        p.unlink()
    plan(job)
    heads, finals = simulate(job)
    truth = write_truth(job, out, heads, finals)
    chunks = max(1, workers) * 8
    per = math.ceil(job.ranks / chunks)
    tasks = [(out, list(range(i, min(job.ranks, i + per)))) for i in range(0, job.ranks, per)]
    if workers <= 1 or job.ranks < 64:
        _init_worker(job, heads, finals)
        for t in tasks:
            _write_ranks(t)
    else:
        ctx = mp.get_context("fork")
        with ctx.Pool(workers, initializer=_init_worker, initargs=(job, heads, finals)) as pool:
            res = pool.map_async(_write_ranks, tasks)
            res.get(timeout=1800)
    return truth


# ----------------------------------------------------------------------------- schema check


def _shape(v: Any) -> Any:
    if isinstance(v, dict):
        return {k: _shape(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        inner = sorted({json.dumps(_shape(x), sort_keys=True) for x in v})
        return [type(v).__name__, *inner[:3]]
    return type(v).__name__


def _load(path: Path) -> Any:
    if path.suffix == ".json":
        return json.loads(path.read_text())
    with path.open("rb") as f:
        return pickle.load(f)


def check_against(real: Path, synth: Path) -> int:
    """Load a real dump and a synthetic one through the same code; compare top-level key order,
    entry key order and the type/shape of every field. 0 when they agree."""
    def first(d: Path) -> Path:
        files = sorted((p for p in d.iterdir()
                        if "trace_rank_" in p.name and not p.name.startswith(".")),
                       key=lambda p: (len(p.name), p.name))
        if not files:
            raise SystemExit(f"no dump in {d}")
        return files[0]

    a, b = _load(first(real)), _load(first(synth))
    problems = []
    if list(a) != list(b):
        problems.append(f"top-level keys: real {list(a)} vs synthetic {list(b)}")
    ea, eb = a.get("entries", []), b.get("entries", [])
    if ea and eb:
        if list(ea[0]) != list(eb[0]):
            problems.append(f"entry keys: real {list(ea[0])}\n   vs synthetic {list(eb[0])}")
        for k in ea[0]:
            ta = {json.dumps(_shape(e.get(k)), sort_keys=True) for e in ea}
            tb = {json.dumps(_shape(e.get(k)), sort_keys=True) for e in eb}
            if not ta & tb:
                problems.append(f"entry field {k!r}: real {sorted(ta)} vs synthetic {sorted(tb)}")
    for k in a:
        if k != "entries" and k in b:
            sa, sb = _shape(a[k]), _shape(b[k])
            ra = json.dumps(sa, sort_keys=True)
            if isinstance(sa, dict) and isinstance(sb, dict):
                va = {json.dumps(x, sort_keys=True) for x in sa.values()}
                vb = {json.dumps(x, sort_keys=True) for x in sb.values()}
                if va and vb and not va & vb:
                    problems.append(f"{k}: real values {sorted(va)} vs synthetic {sorted(vb)}")
            elif ra != json.dumps(sb, sort_keys=True):
                problems.append(f"{k}: real {ra} vs synthetic {json.dumps(sb)}")
    for p in problems:
        print("MISMATCH", p)
    print(f"compared {first(real)} with {first(synth)}: "
          f"{'OK' if not problems else f'{len(problems)} mismatch(es)'}")
    return 1 if problems else 0


# ----------------------------------------------------------------------------- CLI


def parse_mesh(mesh: str | None, ranks: int) -> tuple[int, int]:
    if mesh:
        a, b = (int(x) for x in mesh.lower().split("x"))
    else:
        b = 8 if ranks % 8 == 0 and ranks >= 16 else 2
        a = ranks // b
    if a * b != ranks or a < 2 or b < 2:
        raise SystemExit(f"--mesh {mesh}: need DPxTP with DP*TP == --ranks {ranks}, both >= 2")
    return a, b


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.splitlines()[1:]))
    ap.add_argument("out", type=Path, nargs="?")
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--entries", type=int, default=200)
    ap.add_argument("--mesh", default=None, help="DPxTP, e.g. 64x128 (default: N/8 x 8)")
    ap.add_argument("--fault", choices=FAULTS, default="missing_rank")
    ap.add_argument("--format", dest="fmt", choices=("pickle", "json"), default="pickle")
    ap.add_argument("--backend", choices=("nccl", "gloo"), default="nccl")
    ap.add_argument("--version", default="2.13", choices=RELEASES,
                    help="torch release whose dump format to write (default 2.13)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--frames", action="store_true", help="include Python stack frames (pickle)")
    ap.add_argument("--timing", action="store_true",
                    help="as with TORCH_NCCL_ENABLE_TIMING: started states, duration_ms (NCCL)")
    ap.add_argument("--p2p", action="store_true", help="send/recv in every step (auto for p2p)")
    ap.add_argument("--prefix", default=None, help="file prefix (default: the release's)")
    ap.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--check-against", type=Path, default=None, metavar="REAL_DIR",
                    help="compare the schema of REAL_DIR's first dump with OUT's and exit")
    a = ap.parse_args(argv)
    if a.out is None:
        ap.error("OUT_DIR is required")
    if a.check_against:
        return check_against(a.check_against, a.out)
    schema = schema_for(a.version)
    minor = int(a.version.split(".")[1])
    if a.backend == "gloo" and minor < 8:
        ap.error(f"gloo has no Flight Recorder before torch 2.8 (asked for {a.version})")
    if a.fmt == "json" and not schema.has_json:
        ap.error(f"torch {a.version} has no JSON dump (dump_json arrived in 2.5)")
    if a.entries < 1 or a.ranks < 4:
        ap.error("need --entries >= 1 and --ranks >= 4")
    dp, tp = parse_mesh(a.mesh, a.ranks)
    p2p = a.p2p or a.fault == "p2p"
    if p2p and dp % 2:
        ap.error("p2p needs an even DP dimension (dp neighbours pair up)")
    job = Job(ranks=a.ranks, dp=dp, tp=tp, backend=a.backend, schema=schema, fmt=a.fmt,
              entries=a.entries, seed=a.seed, frames=a.frames, timing=a.timing, p2p=p2p,
              prefix=a.prefix or schema.prefix, fault=a.fault)
    t0 = time.monotonic()
    truth = generate(job, a.out, a.workers)
    dt = time.monotonic() - t0
    size = sum(p.stat().st_size for p in a.out.glob(f"{job.prefix}*"))
    print(f"wrote {a.ranks} dumps ({size / 1e6:.1f} MB) to {a.out} in {dt:.1f} s; fault "
          f"{a.fault}: culprits {truth['culprits']} group {truth.get('group', {}).get('name')} "
          f"seq {truth.get('seq')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
