"""The command line: parse, check, call one ``commands`` function, render, exit. Nothing else
here."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from moe_hang import __version__
from moe_hang.cli_params import (
    _ANALYZE_EXAMPLE,
    _CHECK_EXAMPLE,
    _DIAGNOSE_EXAMPLE,
    _REPRO_EXAMPLE,
    _SCENARIO_DEFAULTS,
    _VERIFY_EXAMPLE,
    _WATCH_EXAMPLE,
    Html,
    Json,
    Out,
    Ras,
    SharedDir,
    Verbose,
    scenario_options,
)
from moe_hang.cli_typer import _Command, _Group
from moe_hang.config import build_config, require_gpu_per_rank
from moe_hang.errors import EXIT_TOOL_ERROR, Interrupted, MoeHangError
from moe_hang.probe.layout import RunLayout
from moe_hang.settings import Settings

if TYPE_CHECKING:
    from moe_hang.analysis.diagnosis import Diagnosis
    from moe_hang.report.screen import ReportContext


app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  rich_markup_mode="markdown", cls=_Group,
                  help="Find, explain and prove the fix for collective deadlocks in "
                       "distributed PyTorch (MoE + LoRA first).")

@contextlib.contextmanager
def _errors(interrupted: str) -> Iterator[None]:
    """The project's error becomes one line and exit 1; an interrupt, one line and 130/143."""
    try:
        yield
    except MoeHangError as exc:
        typer.echo(f"[error] {exc}", err=True)
        raise typer.Exit(EXIT_TOOL_ERROR) from None
    except Interrupted as exc:
        typer.echo(f"[error] interrupted ({exc}){interrupted}", err=True)
        raise typer.Exit(exc.exit_code) from None


def _command() -> list[str]:
    return ["moe-hang", *sys.argv[1:]]


def _check_paths(out: Path | None, html: Path | None) -> None:
    """Where the run will write, before anything starts (raises MoeHangError)."""
    from moe_hang.commands.checks import check_html, check_out

    check_out(out)
    check_html(html, out)


def _show(diag: Diagnosis, ctx: ReportContext, *, as_json: bool, verbose: bool,
          html: Path | None, console_log: Path | None) -> None:
    """The first screen (the detail too with --verbose); --json prints only the JSON.
    console.log and the HTML page always hold everything."""
    # each import where it is used: --json of 8192 ranks' dumps needs no rich
    try:
        if as_json:
            from moe_hang.report.json import to_json

            typer.echo(to_json(diag))
        else:
            from moe_hang.report.console import make_console, render

            render(diag, make_console(), ctx, verbose=verbose)
    except BrokenPipeError:
        # the reader went (``| head``): the files below and the verdict's exit code stand
        _stdout_to_devnull()
    if console_log is not None:
        from moe_hang.report.html import save_console_log

        save_console_log(diag, ctx, console_log)
    if html is not None:
        from moe_hang.report.html import save_html

        try:
            save_html(diag, ctx, html)
        except OSError as exc:
            # checked up front; if it went away since, the verdict (and its exit code) stand
            typer.echo(f"[error] --html {html}: cannot write it ({exc.strerror}); the report "
                       "is in console.log", err=True)


def _stdout_to_devnull() -> None:
    """Whatever is still to be written to a closed pipe goes nowhere (the interpreter's
    last flush would fail again)."""
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())


def _run_scenario(kind: str, *, variant: str, fix: str | None, opts: dict[str, Any]) -> None:
    from moe_hang.commands import repro as commands
    from moe_hang.report.screen import ReportContext, next_verify_command
    from moe_hang.report.status import live_status

    given = dict(opts)
    out, as_json, html = opts.pop("out"), opts.pop("as_json"), opts.pop("html")
    verbose = opts.pop("verbose")
    with _errors("; every process this run started was ended"):
        settings = Settings.from_env(os.environ)  # the tool's own waits: MOE_HANG_<FIELD>
        cfg = build_config(variant=variant, fix=fix, stall_s=opts.pop("stall"), **opts)
        _check_paths(out, html)
        if cfg.backend == "nccl":
            require_gpu_per_rank(cfg.nproc, timeout_s=settings.gpu_check_timeout_s)
        with live_status(enabled=not as_json, settings=settings) as term:
            run = commands.repro if kind == "repro" else commands.verify
            res = run(cfg, str(out) if out else None, term.say, _command(), settings)
    title = "moe-hang repro" if kind == "repro" else (
        "moe-hang verify --fixed" if variant == "fixed" else "moe-hang verify")
    nxt = (next_verify_command(given, _SCENARIO_DEFAULTS, res.scenario) if kind == "repro"
           else None)
    _show(res.diagnosis, ReportContext(kind, title, nxt), as_json=as_json, verbose=verbose,
          html=html, console_log=res.run_dir.console_log)
    raise typer.Exit(res.exit_code)


@app.command(cls=_Command, epilog=_REPRO_EXAMPLE)
@scenario_options
def repro(*, opts: dict[str, Any]) -> None:
    """Launch the minimal MoE+LoRA model with the *unfixed* exchange and reproduce the hang.

    Exit 3 when reproduced, 0 when ruled out (it ran clean), 1 on a tool error.
    """
    _run_scenario("repro", variant="broken", fix=None, opts=opts)


@app.command(cls=_Command, epilog=_VERIFY_EXAMPLE)
@scenario_options
def verify(fixed: Annotated[bool, typer.Option("--fixed", help="run the fix and prove it")]
           = False,
           fix: Annotated[str | None, typer.Option(
               "--fix", help="varlen | a2a (ep-*), all-experts (fsdp-skip); default: the "
                             "scenario's first")] = None,
           *, opts: dict[str, Any]) -> None:
    """With --fixed: run the fix, check every step completes and matches a single-process
    reference (exit 0, or 4). Without: check the broken code still reproduces (exit 0, or 4)."""
    _run_scenario("verify", variant="fixed" if fixed else "broken", fix=fix, opts=opts)


@app.command(cls=_Command, epilog=_DIAGNOSE_EXAMPLE)
def diagnose(pid: Annotated[int | None, typer.Argument(
                 metavar="PID", help="the torchrun agent's PID or any rank's (default: the "
                                     "one distributed job on this host)")] = None,
             as_json: Json = False,
             out: Annotated[Path | None, typer.Option(
                 "--out", help="keep the captures here (default: not kept)")] = None,
             native: Annotated[bool, typer.Option("--native",
                                                  help="include native frames (slower)")]
             = False,
             fr_dir: Annotated[Path | None, typer.Option(
                 "--fr-dir", help="Flight Recorder dumps of this job (pickle or JSON)")] = None,
             html: Html = None, verbose: Verbose = False, shared_dir: SharedDir = None,
             ras: Ras = None) -> None:
    """Diagnose a running job you did not start: find its ranks, capture their stacks (and
    Flight Recorder dumps where present, and on NCCL jobs two RAS reports) and name the hang;
    the ranks of other nodes come from their watchers where `moe-hang watch` runs. Exit 3 on
    a problem, 0 if healthy."""
    from moe_hang.analysis.diagnosis import exit_code_for
    from moe_hang.commands.checks import check_ras
    from moe_hang.commands.diagnose import diagnose_pid, pick_job
    from moe_hang.commands.session import interruptible
    from moe_hang.report.screen import ReportContext
    from moe_hang.report.status import live_status

    with _errors(""):
        settings = Settings.from_env(os.environ)
        _check_paths(out, html)
        polls = check_ras(ras)
        pid = pid if pid is not None else pick_job()
        with interruptible(), live_status(enabled=not as_json, settings=settings) as term:
            diag = diagnose_pid(pid, term.say, settings=settings, out=out, native=native,
                                fr_dir=fr_dir, command=_command(), shared_dir=shared_dir,
                                ras=polls)
    _show(diag, ReportContext("diagnose", f"moe-hang diagnose {pid}"), as_json=as_json,
          verbose=verbose, html=html,
          console_log=RunLayout(Path(diag.artifacts)).console_log if diag.artifacts else None)
    raise typer.Exit(exit_code_for(diag.verdict))


@app.command(cls=_Command, epilog=_WATCH_EXAMPLE, options_metavar="[OPTIONS] --",
             context_settings={"allow_interspersed_args": False})
def watch(command: Annotated[list[str] | None, typer.Argument(
              metavar="COMMAND", help="the job to run, after --: e.g. -- torchrun "
                                      "--nproc-per-node 2 train.py")] = None,
          stall: Annotated[float, typer.Option("--stall", help="seconds without progress "
                                               "while a rank waits = stalled")] = 10.0,
          out: Out = None, as_json: Json = False, html: Html = None,
          native: Annotated[bool, typer.Option("--native", help="native frames in stacks")]
          = False, verbose: Verbose = False,
          hang_after: Annotated[float, typer.Option(
              "--hang-after", help="seconds an uncertain stall (a rank outside any "
                                   "collective) is waited out before it is a hang; 0: never")]
          = 300.0,
          keep_running: Annotated[bool, typer.Option(
              "--keep-running", help="after a verdict, leave the job running")] = False,
          shared_dir: SharedDir = None) -> None:
    """Run any training command with the probe injected into every rank; diagnose it the
    moment it stalls, desyncs, crashes or loses a rank, then end it — unless the evidence is
    uncertain (a rank outside any collective may only be slow): then it says so and watches
    on. `kill -USR1 <watch pid>` diagnoses now and lets the job run. A multi-node job (one
    watch per node) gets one verdict on every node. Exit 3 on a problem, the job's own exit
    code otherwise."""
    from moe_hang.commands.supervise import WatchOptions
    from moe_hang.commands.watch import watch_command
    from moe_hang.report.screen import ReportContext
    from moe_hang.report.status import JobOutput, live_status

    # the job's bytes go through untouched: to stdout, or to stderr with --json
    job_stream = (sys.stderr if as_json else sys.stdout).buffer
    with _errors("; the job and every process it started were ended"):
        settings = Settings.from_env(os.environ)
        if stall <= 0:
            raise MoeHangError(f"--stall {stall}: must be a positive number of seconds")
        if hang_after < 0:
            raise MoeHangError(f"--hang-after {hang_after}: must be 0 (never) or a number of "
                               "seconds")
        _check_paths(out, html)
        with live_status(enabled=not as_json, settings=settings, job=job_stream) as term:
            res = watch_command(list(command or []), term.say, JobOutput(term),
                                out=str(out) if out else None, command=_command(),
                                options=WatchOptions(stall_s=stall, hang_after_s=hang_after,
                                                     keep_running=keep_running,
                                                     native=native,
                                                     shared_dir=str(shared_dir) if shared_dir
                                                     else None, timings=settings))
    if res.diagnosis is not None:
        _show(res.diagnosis, ReportContext("watch", "moe-hang watch"), as_json=as_json,
              verbose=verbose, html=html, console_log=res.run_dir.console_log)
    else:
        typer.echo(f"[moe-hang] the job exited with code {res.outcome.returncode} and no rank "
                   "ever started: nothing to diagnose", err=True)
    raise typer.Exit(res.exit_code)


@app.command(cls=_Command, epilog=_CHECK_EXAMPLE, options_metavar="[OPTIONS] --",
             context_settings={"allow_interspersed_args": False})
def check(command: Annotated[list[str] | None, typer.Argument(
              metavar="COMMAND", help="your job, after --, with a small config and a few "
                                      "steps")] = None,
          plans: Annotated[int, typer.Option("--plans", help="at most this many routing "
                                             "plans")] = 8,
          stall: Annotated[float, typer.Option("--stall", help="seconds without progress "
                                               "while a rank waits = stalled")] = 5.0,
          timeout: Annotated[float, typer.Option("--timeout", help="seconds each run may "
                                                 "take before it is ended")] = 300.0,
          router: Annotated[str | None, typer.Option(
              "--router", help="pkg.mod.Class: your router's class (default: any module "
                               "with an `experts` and a `gate`/`router` child)")] = None,
          out: Out = None, as_json: Json = False, html: Html = None) -> None:
    """Run your own MoE job under adversarial routing plans (each expert starved on one
    rank, the mirror, every token to one expert) and say which plan makes it hang, on which
    rank, expert and step. Exit 3 when a plan reproduces a hang, 0 when every plan ran
    clean (that rules out those plans, not every input)."""
    from moe_hang.commands.check import check_command
    from moe_hang.commands.watch import resolve_command
    from moe_hang.probe.routing import ENV_ROUTER
    from moe_hang.report.check import check_screen
    from moe_hang.report.console import make_console
    from moe_hang.report.status import live_status

    with _errors("; the job and every process it started were ended"):
        settings = Settings.from_env(os.environ)
        cmd = resolve_command(list(command or []))
        if stall <= 0 or timeout <= 0:
            raise MoeHangError("--stall and --timeout must be positive numbers of seconds")
        if router is not None and (router.count(".") < 1 or " " in router):
            raise MoeHangError(f"--router {router}: give the class as pkg.module.Class")
        _check_paths(out, html)
        if router is not None:
            os.environ[ENV_ROUTER] = router  # the job's ranks inherit it
        with live_status(enabled=not as_json, settings=settings) as term:
            res = check_command(cmd, term.say, settings=settings, out=str(out) if out else None,
                                stall_s=stall, timeout_s=timeout, max_plans=plans,
                                command=_command())
    if html is not None:
        from moe_hang.report.check_html import save_check_html

        try:
            save_check_html(res, res.diagnoses, html)
        except OSError as exc:  # checked up front; the result and its exit code stand
            typer.echo(f"[error] --html {html}: cannot write it ({exc.strerror})", err=True)
    if as_json:
        import json

        typer.echo(json.dumps(res.to_dict(), indent=2))
    else:
        console = make_console()
        for line in check_screen(res, console.width):
            console.print(line)
    raise typer.Exit(res.exit_code)


@app.command(cls=_Command, epilog=_ANALYZE_EXAMPLE)
def analyze(paths: Annotated[list[Path] | None, typer.Argument(
                metavar="PATH", help="capture directories of one job (one per node), or "
                "Flight Recorder dumps: a directory, a file prefix, files")] = None,
            as_json: Json = False, html: Html = None, verbose: Verbose = False,
            force: Annotated[bool, typer.Option(
                "--force", help="merge even captures that look like different jobs")]
            = False, ras: Ras = None) -> None:
    """One verdict from what a job left behind: moe-hang's captures (one per node),
    torch's own Flight Recorder dumps (a directory, a TORCH_FR_DUMP_TEMP_FILE prefix, or the
    files) and NCCL RAS reports (`--ras`), alone or together."""
    from moe_hang.analysis.diagnosis import exit_code_for
    from moe_hang.commands.checks import check_ras
    from moe_hang.commands.diagnose import analyze_paths
    from moe_hang.report.screen import ReportContext

    with _errors(""):
        settings = Settings.from_env(os.environ)
        _check_paths(None, html)
        polls = check_ras(ras)
        if not paths and not polls:
            raise MoeHangError("nothing to analyze: give PATH... (captures or Flight "
                               "Recorder dumps) or --ras FILE")
        diag = analyze_paths(list(paths or []), force=force, ras=polls, settings=settings)
    _show(diag, ReportContext("analyze", "moe-hang analyze"), as_json=as_json,
          verbose=verbose, html=html, console_log=None)
    raise typer.Exit(exit_code_for(diag.verdict))


def _version(value: bool) -> None:
    if value:
        typer.echo(f"moe-hang {__version__}")
        raise typer.Exit(0)


@app.callback()
def _main(version: Annotated[bool, typer.Option("--version", callback=_version,
                                                is_eager=True, help="print the version")]
          = False) -> None:
    pass


def main() -> None:
    try:
        app(prog_name="moe-hang")  # the usage line reads as the user types it
    except SystemExit:
        raise
    except KeyboardInterrupt:
        typer.echo("[error] interrupted", err=True)
        sys.exit(130)
    except Exception as exc:  # a bug of ours: still one line, the traceback on request
        if os.environ.get("MOE_HANG_DEBUG"):
            raise
        typer.echo(f"[error] internal error: {type(exc).__name__}: {exc} "
                   "(set MOE_HANG_DEBUG=1 for the traceback)", err=True)
        sys.exit(EXIT_TOOL_ERROR)


if __name__ == "__main__":
    main()
