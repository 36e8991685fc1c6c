"""``repro`` and ``verify``: the scenario's job run under watch's machinery, diagnosed.

config -> torchrun command -> watch_command (probe, monitor, capture, analysis) -> here; verify
--fixed adds the single-process reference. Every process started here is ended before these
functions return, whatever happens.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import subprocess
import time
from dataclasses import dataclass

from moe_hang.analysis.diagnosis import (
    PROBLEM_VERDICTS,
    Diagnosis,
    exit_code_for,
)
from moe_hang.analysis.runs import ReferenceReport, ScenarioRun, Timings
from moe_hang.analysis.verification import verify_fixed
from moe_hang.commands.session import Phase, interruptible, save
from moe_hang.commands.supervise import WatchOptions
from moe_hang.commands.watch import watch_command
from moe_hang.config import RunConfig
from moe_hang.errors import EXIT_OK, EXIT_VERIFY_FAILED, MoeHangError
from moe_hang.evidence.torchrun_log import notable_log_lines, read_job_log
from moe_hang.probe.layout import RankFiles, RunLayout
from moe_hang.runtime import launcher, rundir
from moe_hang.runtime.procs import starting_child
from moe_hang.runtime.reference import finish_reference, reference_report, start_reference
from moe_hang.runtime.watchevent import EventKind, WatchEvent
from moe_hang.scenarios.registry import (
    ENV_RUN_CONFIG,
    FIXES,
    REFERENCE_BATCH,
    REFERENCE_BUILD,
    SCENARIOS,
    recommend_fix,
)
from moe_hang.settings import Settings


@dataclass
class RunResult:
    diagnosis: Diagnosis
    run_dir: RunLayout
    exit_code: int
    outcome: WatchEvent | None = None

    @property
    def scenario(self) -> ScenarioRun:
        assert isinstance(self.diagnosis.run, ScenarioRun)
        return self.diagnosis.run


def _start_reference(cfg: RunConfig, layout: RunLayout) -> subprocess.Popen[bytes]:
    """moe_hang.check's reference runner on the built-in model (scenarios/reference.py):
    it computes while torchrun starts, and compares once told."""
    # float32 throughout: the runner's tolerance by dtype is the one verify always had
    args = ["--reference", REFERENCE_BUILD, "--batch", REFERENCE_BATCH, "--world",
            str(cfg.nproc), "--steps", str(cfg.steps), "--reduce", "sum",
            "--runs", json.dumps([{"run_dir": str(layout.root), "plan": None}])]
    return start_reference(args, layout.reference_log,
                           {**launcher.job_env(), ENV_RUN_CONFIG: str(layout.config)},
                           when_told=True)


def run_scenario(cfg: RunConfig, out_dir: str | None, say: Phase, *, command: list[str],
                 settings: Settings, with_reference: bool = False,
                 native: bool = False) -> RunResult:
    """The scenario's job — torchrun over ``moe_hang.scenarios.worker`` — run the way watch
    and check run a user's job (``watch_command``: the probe, the monitor, the capture of the
    frozen ranks, the diagnosis); what is its own here is the run directory's config, which
    the worker reads, and the reference that verify compares with."""
    layout = RunLayout(rundir.create(out_dir, cfg.label).resolve())
    t0 = time.time()
    cfg = dataclasses.replace(cfg, keep_results=with_reference)
    rundir.write_json(layout.config, cfg.to_dict())
    port = launcher.pick_port(cfg.port)
    argv = launcher.torchrun_argv(cfg.nproc, port, ["-m", "moe_hang.scenarios.worker",
                                                     str(layout.root)],
                                  log_dir=layout.torchrun_dir)
    # repro's run lasts seconds: the monitor looks often, and a job with no rank up after
    # startup_s did not start; a stall the evidence leaves uncertain is final after 3 stalls
    opts = WatchOptions(stall_s=cfg.stall_s, hang_after_s=cfg.stall_s * 3, native=native,
                        poll_s=0.1, refresh_s=1.0, startup_timeout_s=settings.startup_s,
                        world=cfg.nproc, timings=settings,
                        # bounded whatever happens: its process groups time out by then
                        limit_s=settings.startup_s + cfg.pg_timeout_s)
    ref: subprocess.Popen[bytes] | None = None
    ref_report: ReferenceReport | None = None
    completed = False
    with interruptible():
        try:
            if with_reference:  # computed while torchrun starts, compared once it is done
                with starting_child():
                    ref = _start_reference(cfg, layout)
            say(f"launching {cfg.nproc} ranks under torchrun (port {port})")
            # the workers run in the run directory, with moe_hang importable from a checkout
            res = watch_command(argv, say, lambda _: None, options=opts, layout=layout,
                                command=command, meta={"config": cfg.to_dict(), "port": port},
                                base_env=launcher.job_env(), cwd=layout.root)
            outcome = res.outcome
            completed = outcome.kind == EventKind.COMPLETED and res.diagnosis is not None
            if outcome.kind == EventKind.STARTUP_TIMEOUT:
                raise MoeHangError(f"{outcome.reason} (see {layout.job_log})")
            if res.diagnosis is None:
                text = read_job_log(layout.job_log)
                why = notable_log_lines(text, limit=1) or text.strip().splitlines()[-1:]
                raise MoeHangError("torchrun failed before any rank started: "
                                   + (why[0][:300] if why else "no output")
                                   + f" (see {layout.job_log})")
            if ref is not None and completed:
                say("comparing with the single-process reference")
                finish_reference(ref, layout.reference_log, settings.reference_s)
                ref_report = reference_report(layout.reference, layout.reference_log)
        finally:
            if ref is not None and not completed:
                finish_reference(ref, layout.reference_log, settings.reference_s,
                                 compare=False)
    diag = res.diagnosis
    timings = diag.timings or Timings()
    timings.wall_s = round(time.time() - t0, 3)
    if outcome.t_up:
        timings.startup_s = round(outcome.t_up - t0, 3)
    backend = next((hb.backend for hb in outcome.heartbeats.values() if hb.backend),
                   cfg.backend)
    recommended, reason = recommend_fix(cfg.scenario, cfg.model.experts, cfg.model.topk,
                                        cfg.nproc)
    hint = SCENARIOS[cfg.scenario].hint + (f" {reason}" if reason else "")
    diag.run = ScenarioRun(
        scenario=cfg.scenario, variant=cfg.variant, fix=cfg.fix, recommended_fix=recommended,
        fix_hint=(hint if cfg.variant == "broken" else diag.fix or FIXES[cfg.fix].describe),
        backend=backend, nproc=cfg.nproc, tokens=cfg.tokens, timings=timings,
        reference=ref_report)
    return RunResult(diag, layout, EXIT_OK, outcome)


def repro(cfg: RunConfig, out_dir: str | None, say: Phase, command: list[str],
          settings: Settings) -> RunResult:
    res = run_scenario(cfg, out_dir, say, command=command, settings=settings)
    res.exit_code = exit_code_for(res.diagnosis.verdict)
    res.scenario.reproduced = res.diagnosis.verdict in PROBLEM_VERDICTS
    save(res.run_dir, res.diagnosis)
    return res


def verify(cfg: RunConfig, out_dir: str | None, say: Phase, command: list[str],
          settings: Settings) -> RunResult:
    fixed = cfg.variant == "fixed"
    res = run_scenario(cfg, out_dir, say, command=command, settings=settings,
                       with_reference=fixed)
    d, run = res.diagnosis, res.scenario
    uncovered = _uncovered(res.run_dir)
    if fixed:
        got = verify_fixed(d.verdict, run.reference, uncovered, fix=cfg.fix, steps=cfg.steps,
                           nproc=cfg.nproc, tokens=cfg.tokens)
        ok = got.ok
        if got.summary is not None:
            d.summary = got.summary
        if uncovered:
            run.uncovered_trainable = uncovered
    else:
        ok = d.verdict in PROBLEM_VERDICTS
        run.reproduced = ok
    run.verified = ok
    res.exit_code = EXIT_OK if ok else EXIT_VERIFY_FAILED
    save(res.run_dir, res.diagnosis)
    return res


def _uncovered(layout: RunLayout) -> list[str]:
    names: list[str] = []
    for p in layout.files_of(RankFiles.COVERAGE):
        with contextlib.suppress(OSError, ValueError):
            for n in json.loads(p.read_text()).get("uncovered_trainable", []):
                if n not in names:
                    names.append(n)
    return names
