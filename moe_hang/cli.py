"""The command line: parse, call one pipeline function, render. Nothing else lives here."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated

import typer

from moe_hang import __version__
from moe_hang.config import DEFAULT_STALL_S, build_config
from moe_hang.diagnosis import EXIT_TOOL_ERROR, exit_code_for
from moe_hang.errors import MoeHangError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  rich_markup_mode="markdown",
                  help="Find, explain and prove the fix for collective deadlocks in "
                       "distributed PyTorch (MoE + LoRA first).")

Scenario = Annotated[str, typer.Option("--scenario", help="ep-ragged | ep-no-anchor | fsdp-skip")]
Nproc = Annotated[int | None,
                  typer.Option("--nproc", help="ranks (default 2, or one per --tokens)")]
Tokens = Annotated[str | None, typer.Option("--tokens", help="per-rank token counts, e.g. 68,401")]
Backend = Annotated[str, typer.Option("--backend", help="auto | gloo | nccl")]
Stall = Annotated[float, typer.Option("--stall", help="seconds without progress = stalled")]
Out = Annotated[Path | None, typer.Option("--out", help="run directory (default runs/<ts>-...)")]
Json = Annotated[bool, typer.Option("--json", help="print only the diagnosis JSON")]
Html = Annotated[Path | None, typer.Option("--html", help="also save the report as HTML")]
Steps = Annotated[int | None, typer.Option("--steps", help="training steps (3; fsdp-skip 5)")]
Hidden = Annotated[int, typer.Option("--hidden", help="model width D")]
Ffn = Annotated[int, typer.Option("--ffn", help="expert FFN width F")]
Experts = Annotated[int | None,
                    typer.Option("--experts", help="experts per layer (default 2×ranks)")]
Topk = Annotated[int, typer.Option("--topk", help="experts per token")]
LoraRank = Annotated[int, typer.Option("--lora-rank", help="LoRA rank r")]
LoraAlpha = Annotated[float, typer.Option("--lora-alpha", help="LoRA alpha")]
Seed = Annotated[int, typer.Option("--seed", help="seed for inputs and weights")]
Dead = Annotated[str | None, typer.Option("--dead-experts",
                                          help="experts no token is routed to, e.g. 3 or 1,3")]
Port = Annotated[int | None, typer.Option("--port", help="rendezvous port (default: a free one)")]
LoraOutside = Annotated[bool, typer.Option(
    "--lora-outside-fsdp", help="fsdp-skip: add LoRA after fully_shard (the wrapping mistake)")]
DeadLayers = Annotated[str | None, typer.Option("--dead-layers",
                                                help="layers where --dead-experts apply")]


def _interrupt_code(exc: BaseException) -> int:
    """128 + the signal, as a shell reports it (130 for Ctrl-C, 143 for SIGTERM)."""
    return 143 if "SIGTERM" in str(exc) else 130


def _fail(exc: MoeHangError) -> typer.Exit:
    typer.echo(f"[error] {exc}", err=True)
    return typer.Exit(EXIT_TOOL_ERROR)


def _command() -> list[str]:
    return ["moe-hang", *sys.argv[1:]]


def _run(kind: str, *, variant: str, fix: str | None, scenario: str, nproc: int | None,
         tokens: str | None, backend: str, stall: float, out: Path | None, as_json: bool,
         html: Path | None, **model: object) -> None:
    from moe_hang import pipeline, report

    try:
        cfg = build_config(scenario=scenario, variant=variant, fix=fix, nproc=nproc,
                           tokens=tokens, backend=backend, stall_s=stall, **model)  # type: ignore[arg-type]
        with report.live_status(enabled=not as_json) as say:
            run = pipeline.repro if kind == "repro" else pipeline.verify
            res = run(cfg, str(out) if out else None, say, _command())
    except MoeHangError as exc:
        raise _fail(exc) from None
    except pipeline.Interrupted as exc:
        typer.echo(f"[error] interrupted ({exc}); every process this run started was ended",
                   err=True)
        raise typer.Exit(_interrupt_code(exc)) from None
    title = "moe-hang repro" if kind == "repro" else (
        "moe-hang verify --fixed" if variant == "fixed" else "moe-hang verify")
    # the report is always rendered (into console.log); --json prints only the JSON
    console = report.make_console(quiet=as_json)
    report.render(res.diagnosis, console, title=title)
    if as_json:
        typer.echo(report.to_json(res.diagnosis))
    report.save_console(console, res.run_dir / "console.log", html)
    raise typer.Exit(res.exit_code)


@app.command()
def repro(scenario: Scenario = "ep-ragged", nproc: Nproc = None, tokens: Tokens = None,
          backend: Backend = "auto", stall: Stall = DEFAULT_STALL_S, out: Out = None,
          as_json: Json = False, html: Html = None, steps: Steps = None, hidden: Hidden = 64,
          ffn: Ffn = 128, experts: Experts = None, topk: Topk = 2, lora_rank: LoraRank = 8,
          lora_alpha: LoraAlpha = 16.0, seed: Seed = 0, dead_experts: Dead = None,
          dead_layers: DeadLayers = None, port: Port = None,
          lora_outside_fsdp: LoraOutside = False) -> None:
    """Launch the minimal MoE+LoRA model with the *unfixed* exchange and reproduce the hang.

    Exit 3 when reproduced, 0 when ruled out (it ran clean), 1 on a tool error.
    """
    _run("repro", variant="broken", fix=None, scenario=scenario, nproc=nproc, tokens=tokens,
         backend=backend, stall=stall, out=out, as_json=as_json, html=html, steps=steps,
         hidden=hidden, ffn=ffn, experts=experts, topk=topk, lora_rank=lora_rank,
         lora_alpha=lora_alpha, seed=seed, dead_experts=dead_experts, dead_layers=dead_layers,
         port=port, lora_outside_fsdp=lora_outside_fsdp)


@app.command()
def verify(fixed: Annotated[bool, typer.Option("--fixed", help="run the fix and prove it")] = False,
           fix: Annotated[str | None, typer.Option(
               "--fix", help="varlen | a2a (ep-*), all-experts (fsdp-skip)")] = None,
           scenario: Scenario = "ep-ragged", nproc: Nproc = None, tokens: Tokens = None,
           backend: Backend = "auto", stall: Stall = DEFAULT_STALL_S, out: Out = None,
           as_json: Json = False, html: Html = None, steps: Steps = None, hidden: Hidden = 64,
           ffn: Ffn = 128, experts: Experts = None, topk: Topk = 2, lora_rank: LoraRank = 8,
           lora_alpha: LoraAlpha = 16.0, seed: Seed = 0, dead_experts: Dead = None,
           dead_layers: DeadLayers = None, port: Port = None,
           lora_outside_fsdp: LoraOutside = False) -> None:
    """With --fixed: run the fix, check every step completes and matches a single-process
    reference (exit 0, or 4). Without: check the broken code still reproduces (exit 0, or 4)."""
    _run("verify", variant="fixed" if fixed else "broken", fix=fix, scenario=scenario,
         nproc=nproc, tokens=tokens, backend=backend, stall=stall, out=out, as_json=as_json,
         html=html, steps=steps, hidden=hidden, ffn=ffn, experts=experts, topk=topk,
         lora_rank=lora_rank, lora_alpha=lora_alpha, seed=seed, dead_experts=dead_experts,
         dead_layers=dead_layers, port=port, lora_outside_fsdp=lora_outside_fsdp)


def _show(diag: object, *, as_json: bool, title: str, html: Path | None,
          save_to: Path | None) -> None:
    from moe_hang import report

    console = report.make_console(quiet=as_json)
    report.render(diag, console, title=title)  # type: ignore[arg-type]
    if as_json:
        typer.echo(report.to_json(diag))  # type: ignore[arg-type]
    if save_to is not None or html is not None:
        report.save_console(console, save_to / "console.log" if save_to else None, html)


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
    from moe_hang import attach, pipeline, report

    try:
        with pipeline.interruptible(), report.live_status(enabled=not as_json) as say:
            diag = attach.diagnose_pid(pid, say, out=out, native=native, fr_dir=fr_dir,
                                       command=_command())
    except MoeHangError as exc:
        raise _fail(exc) from None
    except pipeline.Interrupted as exc:
        typer.echo(f"[error] interrupted ({exc})", err=True)
        raise typer.Exit(_interrupt_code(exc)) from None
    _show(diag, as_json=as_json, title=f"moe-hang diagnose {pid}", html=html,
          save_to=Path(diag.artifacts) if diag.artifacts else None)
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
    from moe_hang import pipeline, report, supervise

    if stall <= 0:
        raise _fail(MoeHangError(f"--stall {stall}: must be a positive number of seconds"))

    def echo(line: str) -> None:
        # the job's own output goes through untouched (to stderr with --json)
        typer.echo(line, err=as_json)

    try:
        with report.live_status(enabled=not as_json) as say:
            res = supervise.watch_command(list(command or []), say, echo, out=str(out) if out
                                          else None, stall_s=stall, native=native,
                                          command=_command())
    except MoeHangError as exc:
        raise _fail(exc) from None
    except pipeline.Interrupted as exc:
        typer.echo(f"[error] interrupted ({exc}); the job and every process it started "
                   "were ended", err=True)
        raise typer.Exit(_interrupt_code(exc)) from None
    if res.diagnosis is not None:
        _show(res.diagnosis, as_json=as_json, title="moe-hang watch", html=html,
              save_to=res.run_dir)
    else:
        typer.echo(f"[moe-hang] the job exited with code {res.outcome.returncode} and no rank "
                   "ever started: nothing to diagnose", err=True)
    raise typer.Exit(res.exit_code)


@app.command()
def analyze(dirs: Annotated[list[Path], typer.Argument(help="capture directories (one per "
                                                        "node) of the same job")],
            as_json: Json = False, html: Html = None) -> None:
    """Merge captures from several nodes (global ranks, hosts) into one verdict."""
    from moe_hang import analysis, collect

    for d in dirs:
        if not d.is_dir():
            raise _fail(MoeHangError(f"{d}: not a directory"))
        if not (d / "ranks").is_dir() and not (d / "stacks").is_dir():
            raise _fail(MoeHangError(f"{d}: not a moe-hang capture (no ranks/ or stacks/)"))
    try:
        diag = analysis.diagnose(collect.load_many(list(dirs)))
    except (OSError, ValueError) as exc:
        raise _fail(MoeHangError(f"cannot read the captures: {exc}")) from None
    _show(diag, as_json=as_json, title="moe-hang analyze", html=html, save_to=None)
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
