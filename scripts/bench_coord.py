"""Cross-node coordination at scale: a real TCPStore, N simulated nodes x R simulated ranks.

Every simulated node is a thread running moe_hang.runtime.coord exactly as a watcher would
(its own two TCPStore connections, its background thread: beats, summary, the request
listener), spread over a few processes. The store's server is this process, as the rendezvous
store is the torchrun agent's. The job is hung with a desync: one rank posted a barrier where
every other rank waits in an all-gather. One node posts the capture request; we measure, per
run, the time from that request to every node holding the global verdict and the global set of
summaries (it travels with the verdict), and the parts on the way. Each node publishes what
``watch`` publishes (moe_hang.commands.multinode.capture_summary): the ranks' state, pending
collective, stack, and the capture itself (moe_hang.capture.bundle: each rank's heartbeat and
recorder dump, its last 8 collectives per group); the analysing node writes every other
node's capture out as a capture directory, reads it with the capture loader and runs the
real verdict engine over all of them (``--basic``: a small stand-in).

    python scripts/bench_coord.py                      # 128 nodes x 8 ranks, 5 runs
    python scripts/bench_coord.py --quick              # 32 nodes x 8 ranks, 2 runs
    python scripts/bench_coord.py --json bench_coord.json

The target: request -> global verdict on every node < 5 s (capture time excluded: ``--capture-s``
adds a simulated local capture on every node, which the protocol then waits for).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import select
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench_coord_evidence import capture as node_capture  # noqa: E402 - scripts/ on the path
from bench_coord_evidence import heartbeats  # noqa: E402

from moe_hang.analysis.diagnosis import Diagnosis  # noqa: E402
from moe_hang.analysis.rules import diagnose  # noqa: E402
from moe_hang.commands import multinode  # noqa: E402
from moe_hang.evidence.model import Evidence, Unreached  # noqa: E402
from moe_hang.evidence.vocab import JobState  # noqa: E402
from moe_hang.runtime import coord  # noqa: E402
from moe_hang.runtime.coord import store as coord_store  # noqa: E402
from moe_hang.testing.script import run  # noqa: E402


def open_channel(host: str, port: int, run: str, args: argparse.Namespace,
                 op_timeout: float) -> coord.Channel | str:
    """The channel a watcher would use (``--shared-dir``: the directory), or why not."""
    if args.shared_dir:
        return coord.DirChannel(args.shared_dir, run, op_timeout=op_timeout)
    ch = coord.StoreChannel(host, port, run, op_timeout=op_timeout)
    return ch if ch.connect(timeout=170, attempt_s=10.0) else f"connect: {ch.gone}"


def run_node(host: str, port: int, run: str, node: int, args: argparse.Namespace,
             requester: int, out: list[dict[str, Any]], done: threading.Barrier) -> None:
    world = args.nodes * args.ranks_per_node
    # a rank inside the job at every size (world // 2 + 3 alone is past a 4-rank job's end)
    culprit = (world // 2 + 3) % world
    rec: dict[str, Any] = {"node": node}
    # watchers start seconds apart on a real cluster; here a burst of 256 connects at once
    # stalls many of them for 5-15 s (this machine's loopback): spread the start-up a little
    if not args.shared_dir:
        time.sleep(node * args.stagger_s)
    ch = open_channel(host, port, run, args, 15.0)
    if isinstance(ch, str):
        out.append(rec | {"error": ch})
        return
    c = coord.Coordinator(ch, str(node), f"sim{node:04d}", poll_s=args.poll_s)
    hbs = heartbeats(node, args.ranks_per_node, world, culprit)
    ranks = sorted(hbs)
    c.register(ranks, hosts_store=(node == 0), world=world, local_world=args.ranks_per_node)
    c.offer_summary(coord.summarize_heartbeats(hbs, node=str(node), host=f"sim{node:04d}"))
    c.start(interval=args.interval, publish_every_s=0.0)
    try:
        if node == requester:
            if not ch.wait("go", 120):
                out.append(rec | {"error": "no go"})
                return
            rec["t_request"] = time.time()
            req = c.request_capture(f"stall seen by node {node}")
        else:
            c.request_event.wait(120)
            req = c.capture_requested()
        rec["t_seen"] = time.time()
        if req is None:
            out.append(rec | {"error": f"no request ({c.gone})"})
            return

        def capture() -> coord.NodeSummary:
            if args.capture_s:
                time.sleep(args.capture_s)
            s = coord.summarize_heartbeats(hbs, node=str(node), host=f"sim{node:04d}",
                                           moving=dict.fromkeys(ranks, False), kind="capture")
            s.capture = node_capture(node, args.ranks_per_node, world, culprit, args.entries)
            return s

        def analyse(sums: dict[str, coord.NodeSummary], missing: list[str]) -> dict[str, Any]:
            if args.basic:
                return coord.basic_verdict(sums, missing, world)
            t0 = time.monotonic()
            ev = Evidence(ranks={}, world_size=world, job=JobState.DESYNC)
            with tempfile.TemporaryDirectory() as nodes:  # each node's capture, as a watch
                multinode.merge_remote(ev, sums, into=Path(nodes))
                if unknown := multinode.unreached_ranks(world, ev.ranks):
                    ev.unreached = Unreached(unknown, local_world=args.ranks_per_node)
                diag = diagnose(ev)
            rec["engine_s"] = time.monotonic() - t0
            return diag.to_dict()

        expected = coord.expected_nodes(world, args.ranks_per_node)
        result = c.run_round(req, capture, analyse, expected, world=world,
                             capture_timeout_s=60, verdict_timeout_s=60)
        v = result.verdict
        # checked once every node has its verdict: 128 simulated watchers share two cores,
        # and one's checking would slow the others' own reading down
        with contextlib.suppress(threading.BrokenBarrierError):
            done.wait(120)
        ch.wait("bench-check", 120)
        rec.update({
            "t_verdict": rec["t_seen"] + result.timings["verdict"],
            "t_ended": rec["t_seen"] + result.timings["ended"],
            "all_captured_s": result.timings.get("all_captured"),
            "analysed_here": result.analysed_here, "local_only": v.local_only,
            "culprits": v.verdict.get("culprit_ranks"), "expected_culprit": culprit,
            "missing": v.missing, "not_ended": result.not_ended,
            # the same verdict and byte for byte the same global set on every node; only the
            # analyst decodes the set here (the others hold it, as a watcher would save it)
            "digest": hashlib.sha256(json.dumps(v.head_json(), sort_keys=True).encode())
            .hexdigest()[:16],
            "verdict_seen_s": result.timings.get("verdict_seen"),
            "global_digest": hashlib.sha256(v.global_raw or b"").hexdigest()[:16],
            "global_bytes": len(v.global_raw or b"")})
        if result.analysed_here:
            rec["verdict"] = v.verdict.get("verdict")
            rec["verdict_json_bytes"] = len(json.dumps(v.verdict))
            rec["nodes_in_global_set"] = len(v.summaries)
            rec["ranks_in_global_set"] = sum(len(s.ranks) for s in v.summaries.values())
        out.append(rec)
    finally:
        c.close()


def read_alone(ch: coord.Channel) -> float:
    """What one watcher does with the verdict once it is there, timed with nothing else
    running: read it and its global set, decode, rebuild the diagnosis it prints. On a
    cluster every node does this at the same time on its own CPU; here 128 simulated nodes
    take turns on two cores."""
    t0 = time.monotonic()
    co = coord.Coordinator(ch, "bench-reader")
    v = co.read_verdict()
    if v is None:
        return float("nan")
    Diagnosis.from_dict(v.verdict)
    return time.monotonic() - t0


def worker(argv: list[str]) -> int:
    """``--worker HOST PORT RUN FIRST COUNT REQUESTER``: COUNT node threads; one JSON line."""
    p = build_parser()
    args = p.parse_args(argv[6:])
    host, port, run, first, count, requester = argv[0], int(argv[1]), argv[2], int(argv[3]), \
        int(argv[4]), int(argv[5])
    out: list[dict[str, Any]] = []
    done = threading.Barrier(count)
    ts = [threading.Thread(target=run_node,
                           args=(host, port, run, n, args, requester, out, done), daemon=True)
          for n in range(first, first + count)]
    for t in ts:
        t.start()
    end = time.monotonic() + 240
    for t in ts:
        t.join(max(0.0, end - time.monotonic()))
    print(json.dumps(out), flush=True)
    return 0


def one_run(i: int, host: str, port: int, args: argparse.Namespace) -> dict[str, Any]:
    run = f"bench{i}-{os.getpid()}-{time.time_ns()}"
    requester = (i * 37 + 11) % args.nodes
    per = -(-args.nodes // args.procs)
    procs: list[subprocess.Popen[str]] = []
    env = dict(os.environ, TORCH_CPP_LOG_LEVEL="FATAL", PYTHONPATH=str(ROOT))
    errlog = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 - closed below
    try:
        for first in range(0, args.nodes, per):
            count = min(per, args.nodes - first)
            cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", host, str(port),
                   run, str(first), str(count), str(requester), "--nodes", str(args.nodes),
                   "--ranks-per-node", str(args.ranks_per_node), "--capture-s",
                   str(args.capture_s), "--interval", str(args.interval), "--poll-s",
                   str(args.poll_s), "--stagger-s", str(args.stagger_s),
                   *(["--shared-dir", args.shared_dir] if args.shared_dir else []),
                   "--entries", str(args.entries), *(["--basic"] if args.basic else [])]
            procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=errlog, text=True,
                                          env=env, start_new_session=True))
        opened = open_channel(host, port, run, args, 60.0)
        if isinstance(opened, str):
            raise RuntimeError(opened)
        ch = opened
        end = time.monotonic() + 200
        while len(ch.members("node")) < args.nodes:
            if time.monotonic() > end or any(p.poll() is not None for p in procs):
                errlog.seek(0)
                raise RuntimeError(f"only {len(ch.members('node'))}/{args.nodes} nodes "
                                   f"registered; workers said: {errlog.read()[-2000:]}")
            time.sleep(0.2)
        time.sleep(max(2 * args.interval, 1.0))  # every node's listener waits on the request
        ch.put("go", b"1")
        end = time.monotonic() + 200
        while len(ch.members("ended")) < args.nodes and time.monotonic() < end:
            time.sleep(0.2)
        ch.put("bench-check", b"1")
        recs: list[dict[str, Any]] = []
        for p in procs:
            assert p.stdout is not None
            ready, _, _ = select.select([p.stdout], [], [], 240)
            if not ready:
                raise RuntimeError("a worker process did not answer")
            recs.extend(json.loads(p.stdout.readline() or "[]"))
            p.wait(30)
        verdict_bytes = len(ch.get("verdict") or b"")
        analyst_node = next((r["node"] for r in recs if r.get("analysed_here")), 0)
        body_bytes = len(ch.get(f"verdict-body/{analyst_node}") or b"")
        alone_s = read_alone(ch)
        ch.close()
    finally:
        for p in procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    p.kill()
                p.wait(10)
        errlog.close()
    errors = [r for r in recs if "error" in r]
    if errors or len(recs) != args.nodes:
        raise RuntimeError(f"{len(errors)} nodes failed, {len(recs)}/{args.nodes} answered: "
                           f"{errors[:3]}")
    t_req = next(r["t_request"] for r in recs if "t_request" in r)
    host_rec = next(r for r in recs if r["node"] == 0)
    analyst = next(r for r in recs if r["analysed_here"])
    return {
        "run": i, "requester": requester,
        "read_alone_s": alone_s,
        "on_a_cluster_s": analyst["t_verdict"] - t_req + alone_s,
        "request_seen_everywhere_s": max(r["t_seen"] for r in recs) - t_req,
        "all_captured_s": analyst["t_seen"] + analyst["all_captured_s"] - t_req,
        "verdict_published_s": analyst["t_verdict"] - t_req,
        "verdict_seen_everywhere_s": max(r["t_seen"] + r["verdict_seen_s"] for r in recs)
        - t_req,
        "verdict_everywhere_s": max(r["t_verdict"] for r in recs) - t_req,
        "store_host_may_end_s": host_rec["t_ended"] - t_req,
        "same_verdict_everywhere": len({r["digest"] for r in recs}) == 1,
        "global_set_complete": (len({r["global_digest"] for r in recs}) == 1
                                and analyst["nodes_in_global_set"] == args.nodes),
        "culprit_found": all(r["culprits"] == [r["expected_culprit"]] for r in recs),
        "analysts": sum(r["analysed_here"] for r in recs),
        "verdict": analyst.get("verdict"),
        "engine_s": analyst.get("engine_s"),
        "verdict_record_bytes": verdict_bytes,
        "verdict_body_bytes": body_bytes,
        "verdict_json_bytes": analyst.get("verdict_json_bytes"),
        "global_set_bytes": analyst["global_bytes"],
        "ranks_in_global_set": analyst["ranks_in_global_set"],
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=128)
    p.add_argument("--ranks-per-node", type=int, default=8)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--procs", type=int, default=4, help="processes the nodes are spread over")
    p.add_argument("--capture-s", type=float, default=0.0,
                   help="simulated local capture time on every node")
    p.add_argument("--interval", type=float, default=0.5, help="background beat interval")
    p.add_argument("--poll-s", type=float, default=0.05, help="the requester's capture poll")
    p.add_argument("--stagger-s", type=float, default=0.05,
                   help="start-up only: node i connects after i x this")
    p.add_argument("--shared-dir", metavar="DIR",
                   help="coordinate through this directory (DirChannel) instead of the store")
    p.add_argument("--basic", action="store_true",
                   help="analyse with coord.basic_verdict instead of the verdict engine")
    p.add_argument("--entries", type=int, default=16,
                   help="recorder entries per rank in each node's capture (the probe's ring "
                        "keeps 256; 16: what the benchmark simulated before)")
    p.add_argument("--quick", action="store_true", help="32 nodes, 2 runs")
    p.add_argument("--json", metavar="OUT", help="write the results here")
    return p


COLUMNS = [("request_seen_everywhere_s", "request seen by all"),
           ("all_captured_s", "all captured"), ("verdict_published_s", "verdict published"),
           ("verdict_seen_everywhere_s", "verdict readable on every node"),
           ("verdict_everywhere_s", "verdict + global set on every node"),
           ("store_host_may_end_s", "store host may end"),
           ("read_alone_s", "one node reads + decodes it, alone"),
           ("on_a_cluster_s", "published + that (each node on its CPU)"),
           ("engine_s", "of which the verdict engine (analyst)")]


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        return worker(sys.argv[2:])
    args = build_parser().parse_args()
    if args.quick:
        args.nodes, args.runs = 32, 2
    dist = coord_store._import_dist()
    from datetime import timedelta

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=60))
    ranks = args.nodes * args.ranks_per_node
    print(f"coordination benchmark: {args.nodes} nodes x {args.ranks_per_node} ranks = {ranks} "
          f"ranks, {args.procs} processes, "
          + (f"directory {args.shared_dir}, " if args.shared_dir
             else f"TCPStore 127.0.0.1:{server.port}, ") +
          f"capture {args.capture_s} s, {os.cpu_count()} CPUs")
    runs = []
    for i in range(args.runs):
        r = one_run(i, "127.0.0.1", server.port, args)
        runs.append(r)
        print(f"  run {i}: verdict on every node {r['verdict_everywhere_s']:.3f} s "
              f"(same everywhere: {r['same_verdict_everywhere']}, culprit found: "
              f"{r['culprit_found']} ({r['verdict']}), record {r['verdict_record_bytes']} B, "
              f"diagnosis {r['verdict_body_bytes']} B, global set "
              f"{r['global_set_bytes']} B)")
    cols = [(k, label) for k, label in COLUMNS if all(r.get(k) is not None for r in runs)]
    med = {k: statistics.median(r[k] for r in runs) for k, _ in cols}
    print()
    print(f"{'from the capture request to':<38} {'median':>8} {'min':>8} {'max':>8}")
    for k, label in cols:
        vals = [r[k] for r in runs]
        print(f"{label:<38} {med[k]:>7.3f}s {min(vals):>7.3f}s {max(vals):>7.3f}s")
    ok = all(r["same_verdict_everywhere"] and r["global_set_complete"] and r["culprit_found"]
             for r in runs)
    target = med["verdict_everywhere_s"] < 5.0
    print(f"\ntarget < 5 s: {'met' if target else 'MISSED'} "
          f"({med['verdict_everywhere_s']:.3f} s); every node the same verdict and the whole "
          f"global set in every run: {ok}")
    if args.json:
        data = {"channel": "dir" if args.shared_dir else "store",
                "analysis": "basic" if args.basic else "engine",
                "nodes": args.nodes, "ranks_per_node": args.ranks_per_node, "ranks": ranks,
                "procs": args.procs, "capture_s": args.capture_s, "cpus": os.cpu_count(),
                "median": med, "runs": runs, "target_s": 5.0, "target_met": target,
                "consistent": ok}
        tmp = Path(args.json + ".tmp")
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, args.json)
    del server
    return 0 if ok and target else 1


if __name__ == "__main__":
    run(main)
