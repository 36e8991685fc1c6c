"""One rank's dump as torch's recorder of a release and backend lays it out, its JSON form,
the files of a set and its truth.json (fr_synth)."""

from __future__ import annotations

import json
import math
import multiprocessing as mp
import pickle
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

from moe_hang.testing.fr_synth.job import (
    TRUTH_NAME,
    Job,
    OpT,
    entry_keys,
    final_step,
    group_of,
    plan,
    simulate,
    template,
)


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
    if job.fault == "stall":
        o = template(job, 0)[job.fault_index]
        gi = group_of(job, 0, job.fault_group)
        n_c = sum(1 for x in template(job, 0) if x.group == job.fault_group and not x.p2p)
        idx_c = sum(1 for x in template(job, 0)[: job.fault_index + 1]
                    if x.group == job.fault_group and not x.p2p)
        last_step = job.steps_before + math.ceil(job.entries / max(1, len(
            [x for x in template(job, 0) if not (job.backend == "gloo" and x.p2p)]))) + 1
        timed = job.timing and job.backend != "gloo"
        truth.update({
            "group": {"name": gi.name, "desc": gi.desc, "pg_id": gi.pg_id,
                      "size": job.ranks, "ranks": gi.members() if job.ranks <= 256
                      else f"0..{job.ranks - 1}"},
            "seq": last_step * n_c + idx_c, "seq_field": "collective_seq_id",
            "expected_op": profiling_name(job.backend, o, 0, 0),
            "state": "started" if timed else "scheduled",
            "note": "every rank posted this collective and none completed it"
                    + (", every rank's kernel started it" if timed else "")
                    + ": no rank is behind, so no culprit (a transport or hardware hang)"})
    elif job.fault != "none":
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


