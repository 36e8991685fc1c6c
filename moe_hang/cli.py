"""The command line: parse, call one ``commands`` function, render, exit. Nothing else here."""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Annotated, Any

import typer

from moe_hang import __version__
from moe_hang.config import DEFAULT_STALL_S, build_config
from moe_hang.errors import EXIT_TOOL_ERROR, Interrupted, MoeHangError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  rich_markup_mode="markdown",
                  help="Find, explain and prove the fix for collective deadlocks in "
                       "distributed PyTorch (MoE + LoRA first).")

Out = Annotated[Path | None, typer.Option("--out", help="run directory (default runs/<ts>-...)")]
Json = Annotated[bool, typer.Option("--json", help="print only the diagnosis JSON")]
Html = Annotated[Path | None, typer.Option("--html", help="also save the report as HTML")]

# The options repro and verify share: (name, annotation, default), added to both signatures.
_SCENARIO_OPTIONS: list[tuple[str, Any, Any]] = [
    ("scenario", Annotated[str, typer.Option("--scenario",
                                             help="ep-ragged | ep-no-anchor | fsdp-skip")],
     "ep-ragged"),
    ("nproc", Annotated[int | None, typer.Option(
        "--nproc", help="ranks (default 2, or one per --tokens)")], None),
    ("tokens", Annotated[str | None, typer.Option(
        "--tokens", help="per-rank token counts, e.g. 68,401")], None),
    ("backend", Annotated[str, typer.Option("--backend", help="auto | gloo | nccl")], "auto"),
    ("stall", Annotated[float, typer.Option(
        "--stall", help="seconds without progress = stalled")], DEFAULT_STALL_S),
    ("out", Out, None),
    ("as_json", Json, False),
    ("html", Html, None),
    ("steps", Annotated[int | None, typer.Option(
        "--steps", help="training steps (3; fsdp-skip 5)")], None),
    ("hidden", Annotated[int, typer.Option("--hidden", help="model width D")], 64),
    ("ffn", Annotated[int, typer.Option("--ffn", help="expert FFN width F")], 128),
    ("experts", Annotated[int | None, typer.Option(
        "--experts", help="experts per layer (default 2×ranks)")], None),
    ("topk", Annotated[int, typer.Option("--topk", help="experts per token")], 2),
    ("lora_rank", Annotated[int, typer.Option("--lora-rank", help="LoRA rank r")], 8),
    ("lora_alpha", Annotated[float, typer.Option("--lora-alpha", help="LoRA alpha")], 16.0),
    ("seed", Annotated[int, typer.Option("--seed", help="seed for inputs and weights")], 0),
    ("dead_experts", Annotated[str | None, typer.Option(
        "--dead-experts", help="experts no token is routed to, e.g. 3 or 1,3")], None),
    ("dead_layers", Annotated[str | None, typer.Option(
        "--dead-layers", help="layers where --dead-experts apply")], None),
    ("port", Annotated[int | None, typer.Option(
        "--port", help="rendezvous port (default: a free one)")], None),
    ("lora_outside_fsdp", Annotated[bool, typer.Option(
        "--lora-outside-fsdp", help="fsdp-skip: add LoRA after fully_shard (the wrapping "
                                    "mistake)")], False),
]


def scenario_options(fn: Callable[..., None]) -> Callable[..., None]:
    """Give ``fn`` (which takes ``opts: dict``) the shared scenario options as parameters."""
    own = [p for p in inspect.signature(fn, eval_str=True).parameters.values()
           if p.name != "opts"]
    shared = [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, annotation=a, default=d)
              for n, a, d in _SCENARIO_OPTIONS]
    names = [n for n, _, _ in _SCENARIO_OPTIONS]

    @functools.wraps(fn)
    def wrapper(**kwargs: Any) -> None:
        fn(**{k: v for k, v in kwargs.items() if k not in names},
           opts={k: kwargs[k] for k in names})

    wrapper.__signature__ = inspect.Signature(own + shared)  # type: ignore[attr-defined]
    return wrapper


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


def _show(diag: Any, *, as_json: bool, title: str, html: Path | None,
          console_log: Path | None) -> None:
    """The report (always rendered: into console.log too); --json prints only the JSON."""
    from moe_hang.report.console import make_console, render
    from moe_hang.report.html import save_console
    from moe_hang.report.json import to_json

    console = make_console(quiet=as_json)
    render(diag, console, title=title)
    if as_json:
        typer.echo(to_json(diag))
    if console_log is not None or html is not None:
        save_console(console, console_log, html)


def _run_scenario(kind: str, *, variant: str, fix: str | None, opts: dict[str, Any]) -> None:
    from moe_hang.commands import repro as commands
    from moe_hang.report.status import live_status

    out, as_json, html = opts.pop("out"), opts.pop("as_json"), opts.pop("html")
    with _errors("; every process this run started was ended"):
        cfg = build_config(variant=variant, fix=fix, stall_s=opts.pop("stall"), **opts)
        with live_status(enabled=not as_json) as say:
            run = commands.repro if kind == "repro" else commands.verify
            res = run(cfg, str(out) if out else None, say, _command())
    title = "moe-hang repro" if kind == "repro" else (
        "moe-hang verify --fixed" if variant == "fixed" else "moe-hang verify")
    _show(res.diagnosis, as_json=as_json, title=title, html=html,
          console_log=res.run_dir.console_log)
    raise typer.Exit(res.exit_code)


@app.command()
@scenario_options
def repro(*, opts: dict[str, Any]) -> None:
    """Launch the minimal MoE+LoRA model with the *unfixed* exchange and reproduce the hang.

    Exit 3 when reproduced, 0 when ruled out (it ran clean), 1 on a tool error.
    """
    _run_scenario("repro", variant="broken", fix=None, opts=opts)


@app.command()
@scenario_options
def verify(fixed: Annotated[bool, typer.Option("--fixed", help="run the fix and prove it")]
           = False,
           fix: Annotated[str | None, typer.Option(
               "--fix", help="varlen | a2a (ep-*), all-experts (fsdp-skip)")] = None,
           *, opts: dict[str, Any]) -> None:
    """With --fixed: run the fix, check every step completes and matches a single-process
    reference (exit 0, or 4). Without: check the broken code still reproduces (exit 0, or 4)."""
    _run_scenario("verify", variant="fixed" if fixed else "broken", fix=fix, opts=opts)


@app.command()
def diagnose(pid: Annotated[int, typer.Argument(help="the torchrun agent's PID or any rank's")],
             as_json: Json = False,
             out: Annotated[Path | None, typer.Option("--out", help="keep the captures here")]
             = None,
             native: Annotated[bool, typer.Option("--native",
                                                  help="include native frames (slower)")]
             = False,
             fr_dir: Annotated[Path | None, typer.Option(
                 "--fr-dir", help="Flight Recorder dumps of this job (pickle or JSON)")] = None,
             html: Html = None) -> None:
    """Diagnose a running job you did not start: find its ranks, capture their stacks (and
    Flight Recorder dumps where present) and name the hang. Exit 3 on a problem, 0 if healthy."""
    from moe_hang.analysis.diagnosis import exit_code_for
    from moe_hang.commands.diagnose import diagnose_pid
    from moe_hang.commands.session import interruptible
    from moe_hang.report.status import live_status

    with _errors(""), interruptible(), live_status(enabled=not as_json) as say:
        diag = diagnose_pid(pid, say, out=out, native=native, fr_dir=fr_dir,
                            command=_command())
    _show(diag, as_json=as_json, title=f"moe-hang diagnose {pid}", html=html,
          console_log=Path(diag.artifacts) / "console.log" if diag.artifacts else None)
    raise typer.Exit(exit_code_for(diag.verdict))


@app.command(context_settings={"allow_interspersed_args": False})
def watch(command: Annotated[list[str] | None, typer.Argument(
              help="the job to run, after --: e.g. -- torchrun --nproc-per-node 2 train.py")]
          = None,
          stall: Annotated[float, typer.Option("--stall", help="seconds without progress "
                                               "while a rank waits = stalled")] = 10.0,
          out: Out = None, as_json: Json = False, html: Html = None,
          native: Annotated[bool, typer.Option("--native", help="native frames in stacks")]
          = False) -> None:
    """Run any training command with the probe injected into every rank; diagnose it the
    moment it stalls, desyncs, crashes or loses a rank, then end it. Exit 3 on a problem,
    the job's own exit code otherwise."""
    from moe_hang.commands.watch import watch_command
    from moe_hang.report.status import live_status

    def echo(line: str) -> None:
        # the job's own output goes through untouched (to stderr with --json)
        typer.echo(line, err=as_json)

    with _errors("; the job and every process it started were ended"):
        if stall <= 0:
            raise MoeHangError(f"--stall {stall}: must be a positive number of seconds")
        with live_status(enabled=not as_json) as say:
            res = watch_command(list(command or []), say, echo, out=str(out) if out else None,
                                stall_s=stall, native=native, command=_command())
    if res.diagnosis is not None:
        _show(res.diagnosis, as_json=as_json, title="moe-hang watch", html=html,
              console_log=res.run_dir.console_log)
    else:
        typer.echo(f"[moe-hang] the job exited with code {res.outcome.returncode} and no rank "
                   "ever started: nothing to diagnose", err=True)
    raise typer.Exit(res.exit_code)


@app.command()
def analyze(dirs: Annotated[list[Path], typer.Argument(help="capture directories (one per "
                                                        "node) of the same job")],
            as_json: Json = False, html: Html = None) -> None:
    """Merge captures from several nodes (global ranks, hosts) into one verdict."""
    from moe_hang.analysis.diagnosis import exit_code_for
    from moe_hang.commands.diagnose import analyze_dirs

    with _errors(""):
        diag = analyze_dirs(list(dirs))
    _show(diag, as_json=as_json, title="moe-hang analyze", html=html, console_log=None)
    raise typer.Exit(exit_code_for(diag.verdict))


def _version(value: bool) -> None:
    if value:
        typer.echo(f"moe-hang {__version__}")
        raise typer.Exit(0)


@app.callback()
def _main(version: Annotated[bool, typer.Option("--version", callback=_version,
                                                is_eager=True)] = False) -> None:
    pass


def main() -> None:
    try:
        app()
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
