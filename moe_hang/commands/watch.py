"""``moe-hang watch -- COMMAND``: run any job with the probe injected, diagnose it the moment
it stalls, desyncs, crashes or loses a rank, then end it.

The probe reaches every rank without code changes through a ``sitecustomize`` on PYTHONPATH
(it chains to the job's own one). The job runs in its own session; its output is streamed
through and kept in ``job.log``. Ctrl-C / SIGTERM are passed on the way a terminal would
(SIGINT to the job's process group, where torchrun's agent lives), and whatever is left after a
grace period is killed, ranks included, even if the agent died first.
"""

from __future__ import annotations

import codecs
import functools
import os
import shutil
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Protocol, runtime_checkable

from moe_hang.analysis.align import quick_divergence
from moe_hang.analysis.diagnosis import (
    Diagnosis,
    Verdict,
    exit_code_for,
)
from moe_hang.analysis.runs import WatchRun
from moe_hang.commands import multinode, sampling
from moe_hang.commands.session import (
    Interrupted,
    Phase,
    interruptible,
    save,
)
from moe_hang.commands.supervise import (
    AloneOnNode,
    Peers,
    WatchOptions,
    capture_and_diagnose,
    diagnose_watched,
    supervise,
)
from moe_hang.errors import EXIT_OK, MoeHangError
from moe_hang.probe import probe
from moe_hang.probe.env import ENV_DIR, FR_BUFFER
from moe_hang.probe.layout import RunLayout
from moe_hang.runtime import coord, launcher, rundir, shim
from moe_hang.runtime.launcher import LaunchedJob
from moe_hang.runtime.monitor import Monitor
from moe_hang.runtime.procs import is_alive, starting_child
from moe_hang.runtime.watchevent import EventKind, WatchEvent, WatchSettings, world_of
from moe_hang.settings import Settings

PROBE_SITE = Path(probe.__file__).resolve().parent / "_site"


@dataclass
class WatchResult:
    diagnosis: Diagnosis | None
    exit_code: int
    run_dir: RunLayout
    outcome: WatchEvent


def probe_env(layout: RunLayout, base: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    pp = env.get("PYTHONPATH")
    env["PYTHONPATH"] = str(PROBE_SITE) + (os.pathsep + pp if pp else "")
    env[ENV_DIR] = str(layout.ranks_dir)
    # a launch script that replaces PYTHONPATH would drop the probe: a torchrun first on PATH
    # puts it back (runtime/shim.py says what still drops it; then watch samples the ranks)
    env = shim.env_for(shim.install(layout.bin_dir), PROBE_SITE, env)
    # torchrun's --log-dir by environment: its logs stay in the run directory instead of an
    # empty /tmp/torchelastic_* tree left behind by every launch (a job's own flag still wins)
    env.setdefault("PET_LOG_DIR", str(layout.torchrun_dir))
    env.setdefault("TORCH_FR_BUFFER_SIZE", FR_BUFFER)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def _pump(stream: IO[bytes], log: IO[bytes], echo: Callable[[bytes], None]) -> None:
    """The job's output as it comes, in chunks (not lines: a ``\\r`` progress bar must move
    live), to job.log and through ``echo`` unchanged."""
    fd = stream.fileno()
    while True:
        try:
            data = os.read(fd, 65536)
        except OSError:  # the pipe went away with the job
            return
        if not data:
            return
        log.write(data)
        log.flush()
        echo(data)


def resolve_command(cmd: list[str]) -> list[str]:
    if not cmd:
        raise MoeHangError("nothing to watch: give a command after --, "
                           "e.g. moe-hang watch -- torchrun --nproc-per-node 2 train.py")
    exe = cmd[0]
    if os.sep not in exe and shutil.which(exe) is None:
        raise MoeHangError(f"command not found: {exe}")
    if os.sep in exe and not os.access(exe, os.X_OK):
        raise MoeHangError(f"command not found or not executable: {exe}")
    return cmd


@runtime_checkable
class _ByteSink(Protocol):
    def job_bytes(self, data: bytes) -> None: ...


class _Echo:
    """Job output goes through until the verdict or an interrupt; after that (torchrun's
    teardown noise, its interrupt traceback) only to job.log.

    An ``echo`` with ``job_bytes`` (moe_hang.report.status.JobOutput) gets the bytes
    unchanged; a plain line printer gets whole decoded lines."""

    def __init__(self, echo: Callable[[str], None]):
        self.echo, self.on = echo, True
        self._raw = echo.job_bytes if isinstance(echo, _ByteSink) else None
        self._text = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._partial = ""

    def __call__(self, data: bytes) -> None:
        if not self.on:
            return
        if self._raw is not None:
            self._raw(data)
            return
        *lines, self._partial = (self._partial + self._text.decode(data)).split("\n")
        for line in lines:
            self.echo(line)


class _OnDemand:
    """``kill -USR1 <watch pid>``: capture and diagnose now, let the job run on."""

    def __init__(self) -> None:
        self.asked = threading.Event()
        self._old: Any = None

    def __enter__(self) -> _OnDemand:
        if threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGUSR1, lambda *_: self.asked.set())
        return self

    def __exit__(self, *exc: object) -> None:
        if self._old is not None:
            signal.signal(signal.SIGUSR1, self._old)


def watch_command(cmd: list[str], say: Phase, echo: Callable[[str], None], *,
                  out: str | None = None, stall_s: float = 10.0, native: bool = False,
                  command: list[str] | None = None,
                  options: WatchOptions | None = None, layout: RunLayout | None = None,
                  meta: dict[str, Any] | None = None, base_env: dict[str, str] | None = None,
                  cwd: Path | None = None) -> WatchResult:
    """``layout``: a run directory made by the caller (repro's, with its config in it);
    ``meta``: more for its meta.json; ``base_env``, ``cwd``: the job's environment before
    the probe's (default: ours) and its working directory (default: ours)."""
    cmd = resolve_command(cmd)
    opts = options or WatchOptions(stall_s=stall_s, native=native)
    plan = multinode.plan(cmd, opts.shared_dir)  # None: one node, nothing to coordinate
    restarts = coord.torchrun_max_restarts(cmd)
    # multi-node: a rank that raised is held for the round, unless the job is to keep running
    # or torchrun would restart it (a held rank would keep the restart from happening)
    hold_s = None if opts.keep_running or restarts else opts.timings.hold_s
    if layout is None:
        layout = RunLayout(rundir.create(out, "watch").resolve())
    layout.ranks_dir.mkdir(mode=0o700)
    rundir.write_json(layout.meta, rundir.meta(command or ["moe-hang", "watch"], {
        "job_command": cmd, "stall_s": opts.stall_s, **(meta or {})}))
    t0 = time.time()
    log = open(layout.job_log, "ab")  # noqa: SIM115 - closed below
    gate = _Echo(echo)
    job: LaunchedJob | None = None
    outcome = WatchEvent(kind=EventKind.RUNNING)
    diag: Diagnosis | None = None
    pump: threading.Thread | None = None
    node: multinode.Node | None = None
    spread: multinode.SpreadLater | None = None
    interrupted: str | None = None
    ended = False
    # SIGUSR1 is ours from the start: its default action would end the tool, not the job
    demand = _OnDemand().__enter__()
    try:
        with interruptible():
            try:
                with starting_child():
                    job = launcher.start(cmd, layout.job_log,
                                         {**probe_env(layout, base_env), **dict(opts.env)},
                                         cwd=cwd, stream=True)
                assert job.popen.stdout is not None
                pump = threading.Thread(target=_pump, args=(job.popen.stdout, log, gate),
                                        daemon=True)
                pump.start()
                if plan is not None:
                    node = multinode.Node(plan, layout, lambda text: echo(f"[moe-hang] {text}"),
                                          timings=opts.timings, hold_s=hold_s,
                                          stall_s=opts.stall_s)
                    node.attach(job)
                say(f"watching PID {job.pid}: {' '.join(cmd)[:80]}")
                settings = WatchSettings(probe_dir=layout.ranks_dir, world=opts.world,
                                         stall_s=opts.stall_s,
                                         startup_timeout_s=opts.startup_timeout_s,
                                         straggler_notice=True, poll_s=opts.poll_s,
                                         refresh_s=opts.refresh_s,
                                         hang_after_s=opts.hang_after_s, watch_unprobed=True,
                                         max_restarts=restarts, timings=opts.timings)
                mon = Monitor(job, settings, say, quick_check=lambda hbs: (
                    quick_divergence(hbs, world_of(hbs)) is not None),
                    on_notice=lambda text: echo(f"[moe-hang] {text}"),
                    # one node: its ranks sampled when the probe is not in them; the nodes of
                    # a multi-node job speak through their probes' heartbeats
                    sampler=sampling.sampler(opts.timings, native=opts.native)
                    if node is None else None)
                peers: Peers = AloneOnNode()
                if node is not None:
                    peers = multinode.NodePeers(node)
                elif not coord.launches_torchrun(cmd):
                    # srun, mpirun, a launcher of the job's own: spans nodes once its ranks'
                    # world turns out larger than the ranks here. Whether it does shows only
                    # once its ranks are up, and a rank may raise before that: it is held
                    # from the start (on one node too: the capture then sees its peers in
                    # place, and the watcher ends the job as it would have ended itself)
                    if hold_s:
                        rundir.write_json(layout.hold, {"watcher": os.getpid(),
                                                        "limit_s": hold_s})
                    spread = peers = multinode.SpreadLater(functools.partial(
                        _join_spread, job=job, layout=layout, opts=opts, hold_s=hold_s,
                        notice=lambda text: echo(f"[moe-hang] {text}")))
                outcome, diag = supervise(
                    mon, peers, functools.partial(capture_and_diagnose, layout=layout, cmd=cmd,
                                                  say=say, opts=opts),
                    layout, lambda text: echo(f"[moe-hang] {text}"), opts, demand.asked)
                gate.on = diag is None  # torchrun's teardown noise after a verdict: job.log
            except Interrupted as exc:
                gate.on = False  # torchrun's interrupt traceback goes to job.log only
                interrupted = str(exc)
                say("interrupted → stopping the job")
                if job is not None:
                    # the way torchrun expects it: the signal to the whole group, then SIGKILL
                    sig = signal.SIGINT if interrupted == "SIGINT" else signal.SIGTERM
                    job.terminate(grace=3.0, first_signal=sig, group=True)
                    ended = True
            finally:
                gate.on = False
                node = node or (spread.node if spread is not None else None)
                if node is not None:
                    node.close()
                # not ended: no interrupt, or its teardown itself failed (a further Ctrl-C is
                # ignored by interruptible, so it cannot cut that teardown short)
                if job is not None and not ended and interrupted is None \
                        and (diag is None or diag.verdict == Verdict.HEALTHY):
                    _launcher_exit(job, outcome, say, opts.timings)
                if job is not None and not ended:
                    say("ending the job")
                    job.terminate(grace=3.0)
    finally:
        demand.__exit__()
        if pump is not None:
            pump.join(2.0)
        log.close()
        # where a verdict ended the job, the run directory keeps the capture it came from
        after_verdict = interrupted is None and diag is not None \
            and outcome.kind != EventKind.COMPLETED
        if node is not None:
            node.finish(ended_after_verdict=after_verdict)
        elif not after_verdict:
            rundir.drop_snapshot(layout)
        elif (why := rundir.keep_capture(layout)) is not None:
            echo(f"[moe-hang] {why}")
    if interrupted is not None:
        raise Interrupted(interrupted)
    if not outcome.heartbeats and not outcome.rank_pids:
        # not a distributed job (or it died before any rank started): pass its code through
        return WatchResult(None, _own_code(outcome.returncode), layout, outcome)
    if diag is None:
        say("analysing")
        alive = {r: is_alive(pid) for r, pid in outcome.rank_pids.items()}
        diag = diagnose_watched(layout, outcome, alive, cmd)
    if isinstance(diag.run, WatchRun) and diag.run.job_exit_code is None:
        diag.run.job_exit_code = outcome.returncode  # the launcher's teardown ended after it
    if diag.timings is not None:
        diag.timings.wall_s = round(time.time() - t0, 3)
    save(layout, diag)
    code = exit_code_for(diag.verdict)
    if code == EXIT_OK:
        code = _own_code(outcome.returncode)
    return WatchResult(diag, code, layout, outcome)


def _join_spread(mon: Monitor, *, job: LaunchedJob, layout: RunLayout, opts: WatchOptions,
                 hold_s: float | None, notice: Callable[[str], None]) -> multinode.Node | None:
    """A job not started by torchrun, its ranks up: this node's part of one that spans nodes
    when their world is larger than the ranks here (through the store of their ``env://``
    init); None on one node, or when the ranks name no store (then say what would do)."""
    hbs = mon.out.heartbeats
    world = world_of(hbs)
    if mon.out.sampled or not world or world <= len(hbs):
        return None
    p = multinode.plan_from_ranks([hb.pid for hb in hbs.values() if hb.pid is not None])
    if p is None:
        notice(f"ranks {len(hbs)} of a world of {world} run here, and no MASTER_ADDR/"
               "MASTER_PORT names their store: a verdict from this node's ranks only "
               "(give every watcher --shared-dir DIR)")
        return None
    node = multinode.Node(p, layout, notice, timings=opts.timings, hold_s=hold_s,
                          stall_s=opts.stall_s)
    node.attach(job)
    return node


def _launcher_exit(job: LaunchedJob, outcome: WatchEvent, say: Phase,
                   timings: Settings) -> None:
    """A job whose ranks have all exited: its exit code is the launcher's own, not the one of
    ending it, so let its teardown finish, for ``timings.launcher_teardown_s`` at most (a
    torchrun agent leaves the rendezvous in a few seconds; when the agent that hosts the
    store has gone first, the other one waits on it before it gives up)."""
    if job.poll() is None and outcome.rank_pids \
            and not any(is_alive(pid) for pid in outcome.rank_pids.values()):
        say("every rank exited: waiting for the launcher's own exit")
        job.wait_exit(timings.launcher_teardown_s)
    rc = job.poll()
    if rc is not None and outcome.returncode is None:
        outcome.returncode = rc


def _own_code(rc: int | None) -> int:
    """The job's own exit code, shell style for a signal (128 + n)."""
    if rc is None:
        return 1
    return rc if rc >= 0 else 128 - rc

