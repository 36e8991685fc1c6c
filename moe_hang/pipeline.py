"""``repro`` and ``verify``: launch the scenario under torchrun, watch, capture, diagnose.

cli -> config -> launcher -> (workers) -> watchdog -> capture -> collect -> analysis -> here.
Every process started here is ended before these functions return, whatever happens.
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moe_hang import analysis, capture, collect, launcher, rundir
from moe_hang.config import ReproConfig
from moe_hang.diagnosis import (
    EXIT_OK,
    EXIT_VERIFY_FAILED,
    PROBLEM_VERDICTS,
    Diagnosis,
    exit_code_for,
)
from moe_hang.errors import MoeHangError
from moe_hang.evidence import notable_log_lines, parse_torchrun_failures
from moe_hang.launcher import Job
from moe_hang.procs import Tracker, defer_interrupt, end_tree, is_alive, starting_child
from moe_hang.watchdog import Outcome, ProgressSample, WatchSettings, watch

Phase = Callable[[str], None]

FIX_HINTS = {
    "ep-ragged": ("Replace DTensor.from_local(x, mesh, [Shard(0)]).full_tensor() with the varlen "
                  "exchange: all-gather lengths, pad + all-gather + trim, gradient anchor, "
                  "all-reduce + narrow (moe_hang.ep.VarlenDispatch; NeMo Automodel PR #3631)."),
    "fsdp-skip": ("Call every expert every step, with an empty input where this rank routed it "
                  "no token (moe_hang.fsdp.FSDPExperts(call_all=True)), so FSDP's all-gather "
                  "runs on every rank; keep each expert's LoRA inside the same fully_shard unit "
                  "as the weights it adapts (apply LoRA before fully_shard)."),
    "ep-no-anchor": ("Add the gradient anchor y = y + x.sum() * 0 after the local experts "
                     "(moe_hang.ep.anchor_gradients) so every rank's backward runs the gathers' "
                     "all-reduce even when no token reached its experts."),
}


FIXES_UNDER_TEST = {
    "varlen": ("varlen (moe_hang.ep.VarlenDispatch): exchange lengths, pad + all-gather + trim, "
               "gradient anchor, all-reduce + narrow"),
    "a2a": ("a2a (moe_hang.a2a.AllToAllDispatch): per-expert counts, all-to-all dispatch to the "
            "owning rank, experts, reverse all-to-all, combine"),
    "all-experts": ("all-experts (moe_hang.fsdp.FSDPExperts(call_all=True)): every expert is "
                    "called every step, on an empty input where it has no token"),
}


def recommend_fix(cfg: ReproConfig) -> tuple[str, str]:
    """varlen for few experts per token; a2a once E/k is large, with the reason."""
    if cfg.scenario == "fsdp-skip":
        return "all-experts", ""
    ratio = cfg.experts / cfg.topk
    if ratio < 4:
        return "varlen", ""
    w = cfg.nproc
    return "a2a", (
        f"With E/k = {cfg.experts}/{cfg.topk} = {ratio:g}, prefer the all-to-all fix "
        "(--fix a2a, moe_hang.a2a.AllToAllDispatch): it sends each token only to the ranks of "
        f"its {cfg.topk} experts (about 2·k·T·D per rank per layer), where varlen gathers "
        f"every token to all {w} ranks and all-reduces a full-size output (about "
        f"{w}·T·D·(1 + 2·{w - 1}/{w})); prove it with moe-hang verify --fixed --fix a2a.")


class Interrupted(Exception):
    """Ctrl-C or SIGTERM: unwind through every ``finally`` so children are ended."""


@contextlib.contextmanager
def interruptible() -> Iterator[None]:
    """Turn SIGTERM (and SIGINT) into :class:`Interrupted` while a pipeline runs."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    fired: list[int] = []

    def raise_interrupt(signum: int, _frame: Any) -> None:
        if fired:
            # already unwinding: an impatient second Ctrl-C must not abort the teardown half
            # way (and leave ranks behind); the teardown is bounded anyway
            return
        if defer_interrupt(lambda: raise_interrupt(signum, None)):
            return  # a child is being started: raised as soon as it is on record
        fired.append(signum)
        raise Interrupted(signal.Signals(signum).name)

    old = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    for s in old:
        signal.signal(s, raise_interrupt)
    try:
        yield
    finally:
        for s, h in old.items():
            # once interrupted, the command is on its way out with 130/143: a further Ctrl-C
            # must not turn that into a KeyboardInterrupt ("Aborted!", exit 1) on the way
            signal.signal(s, signal.SIG_IGN if fired else h)


@dataclass
class RunResult:
    diagnosis: Diagnosis
    run_dir: Path
    exit_code: int
    outcome: Outcome | None = None
    timings: dict[str, float] = field(default_factory=dict)


def _label(cfg: ReproConfig) -> str:
    return f"{cfg.scenario}-{cfg.variant}" + (f"-{cfg.fix}" if cfg.variant == "fixed" else "")


def _start_reference(run_dir: Path) -> subprocess.Popen[bytes]:
    log = open(run_dir / "reference.log", "wb")  # noqa: SIM115 - child owns it
    try:
        return subprocess.Popen(
            [sys.executable, "-m", "moe_hang.reference", str(run_dir)], stdin=subprocess.PIPE,
            stdout=log, stderr=subprocess.STDOUT, env=launcher.job_env(),
            start_new_session=True)
    finally:
        log.close()


def _finish_reference(ref: subprocess.Popen[bytes], run_dir: Path, compare: bool,
                      timeout: float = 120.0) -> dict[str, Any] | None:
    tracker = Tracker()
    tracker.add(ref.pid)
    try:
        if ref.stdin is not None:
            with contextlib.suppress(BrokenPipeError, OSError):
                ref.stdin.write(b"compare\n" if compare else b"")
                ref.stdin.close()
        if not compare:
            return None
        try:
            ref.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise MoeHangError(f"the single-process reference did not finish within "
                               f"{timeout:.0f} s (see {run_dir / 'reference.log'})") from None
        try:
            return dict(json.loads((run_dir / "reference.json").read_text()))
        except (OSError, ValueError):
            tail = (run_dir / "reference.log").read_text(errors="replace").strip()[-300:]
            raise MoeHangError(f"the single-process reference failed: {tail or 'no output'}"
                               ) from None
    finally:
        end_tree(ref, tracker, grace=1.0)


def capture_stalled(out: Outcome, run_dir: Path, say: Phase, *, native: bool = False) -> None:
    """Stacks from py-spy and Flight Recorder dumps from the probes, at the same time: of every
    rank of a stalled or desynced job, or of the survivors of one that failed."""
    live = {r: pid for r, pid in out.rank_pids.items() if is_alive(pid)}
    stalled = out.kind in ("stalled", "desync")
    what = "stalled → capturing stacks" if stalled else "capturing the surviving ranks"
    say(f"{what} ({len(live)} ranks)")
    dumps: dict[int, str | None] = {}

    def ask_probes() -> None:
        dumps.update(capture.request_dumps(run_dir / "ranks", sorted(live)))

    # a stalled job cannot move by construction; orphans of a dead agent may still be stepping
    sample = None if stalled else ProgressSample(run_dir / "ranks", live)
    t = threading.Thread(target=ask_probes, daemon=True)
    t.start()
    stacks = capture.pyspy_many(live, native=native)
    t.join(capture.DUMP_TIMEOUT_S + 2.0)
    if sample is not None:
        out.progressed = sample.finish()
    capture.save_stacks(stacks, run_dir / "stacks")
    for r, err in dumps.items():
        if err:
            (run_dir / "ranks" / f"rank{r}.dump.err").write_text(err)


def _crash_onset(run_dir: Path) -> float | None:
    times = []
    for p in (run_dir / "ranks").glob("rank*.fatal.txt"):
        with contextlib.suppress(OSError):
            if p.stat().st_size > 0:
                times.append(p.stat().st_mtime)
    for p in (run_dir / "ranks").glob("rank*.error.json"):
        with contextlib.suppress(OSError, ValueError, KeyError):
            times.append(float(json.loads(p.read_text())["time"]))
    return min(times) if times else None


def analyse(run_dir: Path, outcome: Outcome, alive: dict[int, bool], *, world: int | None,
            ranks: Iterable[int], extra: dict[str, Any] | None = None) -> Diagnosis:
    """processes.json from what the watcher saw, then the diagnosis, written at once: when the
    job hung, the ranks are still frozen where they hung, and "onset -> verdict" is the time
    to a diagnosis on disk."""
    log_text = collect.read_job_log(run_dir)
    failures = parse_torchrun_failures(log_text)
    procs: dict[str, Any] = {}
    for r in ranks:
        hb = outcome.heartbeats.get(r, {})
        code = 0 if outcome.kind == "completed" else failures.get(r, (None, None))[0]
        procs[str(r)] = {"pid": outcome.rank_pids.get(r), "host": hb.get("host"),
                         "alive": alive.get(r, False), "exit_code": code}
        if outcome.kind in ("stalled", "desync") and alive.get(r):
            # by construction no rank moved for --stall seconds (or they cannot move)
            procs[str(r)]["progressed"] = False
        elif r in outcome.progressed:
            procs[str(r)]["progressed"] = outcome.progressed[r]
    rc = outcome.returncode
    rundir.write_json(run_dir / "processes.json", {
        "world_size": world, "job": outcome.kind, "job_exit_code": rc,
        "agent_exit_code": rc if rc is not None and rc < 0 else None, "ranks": procs})
    diag = analysis.diagnose(collect.load(run_dir, world=world, job=outcome.kind,
                                          log_text=log_text))
    diag.extra.update(extra or {})
    rundir.write_json(run_dir / "diagnosis.json", diag.to_dict())
    return diag


def run_scenario(cfg: ReproConfig, out_dir: str | None, say: Phase, *, command: list[str],
                 with_reference: bool = False, native: bool = False) -> RunResult:
    run_dir = rundir.create(out_dir, _label(cfg)).resolve()
    (run_dir / "ranks").mkdir(mode=0o700)
    t0 = time.time()
    rundir.write_json(run_dir / "config.json", json.loads(cfg.to_json()))
    port = launcher.pick_port(cfg.port)
    rundir.write_json(run_dir / "meta.json", rundir.meta(command, {
        "config": json.loads(cfg.to_json()), "port": port}))
    ref: subprocess.Popen[bytes] | None = None
    job: Job | None = None
    outcome: Outcome | None = None
    diag: Diagnosis | None = None
    t_verdict = 0.0
    ref_report: dict[str, Any] | None = None
    with interruptible():
        try:
            if with_reference:
                with starting_child():
                    ref = _start_reference(run_dir)
            say(f"launching {cfg.nproc} ranks under torchrun (port {port})")
            argv = launcher.torchrun_argv(cfg.nproc, port, ["-m", "moe_hang.worker",
                                                             str(run_dir)],
                                          log_dir=run_dir / "torchrun")
            with starting_child():
                job = launcher.start(argv, run_dir / "job.log", launcher.job_env(),
                                     cwd=run_dir)
            settings = WatchSettings(probe_dir=run_dir / "ranks", world=cfg.nproc,
                                     stall_s=cfg.stall_s)
            outcome = watch(job, settings, say, quick_check=lambda hbs: analysis.quick_divergence(
                hbs, cfg.nproc) is not None)
            alive = {r: is_alive(pid) for r, pid in outcome.rank_pids.items()}
            if outcome.kind == "failed" and any(alive.values()):
                # the agent died and left its ranks running: see where they are, then end them
                capture_stalled(outcome, run_dir, say, native=native)
            if outcome.kind in ("stalled", "desync"):
                capture_stalled(outcome, run_dir, say, native=native)
                say("analysing")
                # before teardown: the ranks are frozen where they hung
                diag = analyse(run_dir, outcome, alive, world=cfg.nproc,
                               ranks=range(cfg.nproc))
                t_verdict = time.time()
            if outcome.kind == "startup_timeout":
                raise MoeHangError(f"{outcome.reason} (see {run_dir / 'job.log'})")
        finally:
            say("tearing down")
            if job is not None:
                job.terminate()
            if ref is not None and (outcome is None or outcome.kind != "completed"):
                _finish_reference(ref, run_dir, compare=False)
        if outcome.kind == "failed" and not outcome.heartbeats:
            text = collect.read_job_log(run_dir)
            why = notable_log_lines(text, limit=1) or text.strip().splitlines()[-1:]
            raise MoeHangError("torchrun failed before any rank started: "
                               + (why[0][:300] if why else "no output")
                               + f" (see {run_dir / 'job.log'})")
        if ref is not None and outcome.kind == "completed":
            say("comparing with the single-process reference")
            ref_report = _finish_reference(ref, run_dir, compare=True)
    if diag is None:
        say("analysing")
        diag = analyse(run_dir, outcome, alive, world=cfg.nproc, ranks=range(cfg.nproc))
        t_verdict = time.time()
    onset = outcome.onset_ns / 1e9 if outcome.onset_ns else _crash_onset(run_dir)
    timings = {"wall_s": round(time.time() - t0, 3)}
    if outcome.t_up:
        timings["startup_s"] = round(outcome.t_up - t0, 3)
    if onset is not None and diag.verdict != "healthy":
        timings["onset_to_verdict_s"] = round(t_verdict - onset, 3)
        if outcome.t_detect:
            timings["onset_to_detect_s"] = round(outcome.t_detect - onset, 3)
    backend = next((hb.get("progress", {}).get("backend") for hb in outcome.heartbeats.values()),
                   cfg.backend)
    recommended, reason = recommend_fix(cfg)
    hint = FIX_HINTS.get(cfg.scenario, diag.fix) + (f" {reason}" if reason else "")
    diag.extra.update({
        "scenario": cfg.scenario, "variant": cfg.variant, "fix": cfg.fix,
        "recommended_fix": recommended,
        "fix_hint": (hint if cfg.variant == "broken"
                     else diag.fix or FIXES_UNDER_TEST.get(cfg.fix, cfg.fix)),
        "backend": backend, "nproc": cfg.nproc, "tokens": cfg.tokens, "timings": timings,
    })
    if ref_report is not None:
        diag.extra["reference"] = ref_report
    return RunResult(diag, run_dir, EXIT_OK, outcome, timings)


def repro(cfg: ReproConfig, out_dir: str | None, say: Phase, command: list[str]) -> RunResult:
    res = run_scenario(cfg, out_dir, say, command=command)
    res.exit_code = exit_code_for(res.diagnosis.verdict)
    res.diagnosis.extra["reproduced"] = res.diagnosis.verdict in PROBLEM_VERDICTS
    save(res.run_dir, res.diagnosis)
    return res


def verify(cfg: ReproConfig, out_dir: str | None, say: Phase, command: list[str]) -> RunResult:
    fixed = cfg.variant == "fixed"
    res = run_scenario(cfg, out_dir, say, command=command, with_reference=fixed)
    d = res.diagnosis
    uncovered = _uncovered(res.run_dir)
    if fixed:
        ref = d.extra.get("reference") or {}
        ok = d.verdict == "healthy" and bool(ref.get("ok")) and not uncovered
        if d.verdict == "healthy" and not ref.get("ok"):
            fails = "; ".join(ref.get("failures", [])[:3]) or "no comparison"
            d.summary = (f"All steps completed, but the results differ from the single-process "
                         f"reference: {fails}.")
            d.verdict = "healthy"
        if uncovered:
            names = ", ".join(uncovered[:6]) + (" …" if len(uncovered) > 6 else "")
            d.summary = (f"{len(uncovered)} trainable LoRA parameter(s) are outside fully_shard "
                         f"(no gradient reduction, ranks drift apart): {names}. Apply LoRA "
                         "before fully_shard so the adapters shard with the weights they adapt.")
            d.extra["uncovered_trainable"] = uncovered
        elif ok:
            d.summary = (f"Fixed ({cfg.fix}): all {cfg.steps} steps completed on {cfg.nproc} ranks "
                         f"with tokens {','.join(map(str, cfg.tokens))}; outputs, loss and every "
                         f"LoRA gradient match the single-process reference (max abs err "
                         f"{ref['max_abs_err']:.2e}, max rel err {ref['max_rel_err']:.2e} ≤ "
                         f"rtol {ref['rtol']:.0e}).")
    else:
        ok = d.verdict in PROBLEM_VERDICTS
        d.extra["reproduced"] = ok
    d.extra["verified"] = ok
    res.exit_code = EXIT_OK if ok else EXIT_VERIFY_FAILED
    save(res.run_dir, res.diagnosis)
    return res


def _uncovered(run_dir: Path) -> list[str]:
    names: list[str] = []
    for p in sorted((run_dir / "ranks").glob("rank*.coverage.json")):
        with contextlib.suppress(OSError, ValueError):
            for n in json.loads(p.read_text()).get("uncovered_trainable", []):
                if n not in names:
                    names.append(n)
    return names


def save(run_dir: Path, diag: Diagnosis) -> None:
    """The final diagnosis; the probes' FIFOs go, they are only useful while the ranks live."""
    rundir.write_json(run_dir / "diagnosis.json", diag.to_dict())
    with contextlib.suppress(OSError):
        for p in (run_dir / "ranks").glob("rank*.ctl"):
            p.unlink()
