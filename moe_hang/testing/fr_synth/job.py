"""The job fr_synth models: each torch release's dump schema, the 2-D mesh job, its groups,
and what every rank posted in the last step with the planted fault (no files written)."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any

FAULTS = ("missing_rank", "size", "dtype", "op", "order", "p2p", "none")
# symmetric: no rank is to blame. "stall": every rank posted the same collective (the
# grad-norm all-reduce of the default group), and it never completes on any of them — a
# transport or hardware hang; with --timing every rank's kernel *started* it (NCCL)
SYMMETRIC_FAULTS = ("stall",)
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
    if job.fault == "stall":
        job.fault_index = len(tmpl) - 2  # clip_grad_norm_'s all-reduce, on every rank
        job.fault_group = "world"
        return
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
    # "stall": that collective never completes, though every rank posted it alike
    hung = keys[0][job.fault_index] if job.fault == "stall" else None
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
                if n == size_of[g] and k != hung:
                    done.add(k)
        if not done:
            break
        for r in range(job.ranks):
            if head[r] < len(keys[r]) and keys[r][head[r]] in done:
                head[r] += 1
    return head, finals


