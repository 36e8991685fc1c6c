"""The tool's own waits, timeouts and intervals, in one object (:class:`Settings`), passed to
whatever needs one — never imported as a module constant.

Each field is overridden by ``MOE_HANG_<FIELD>`` (``MOE_HANG_PYSPY_TIMEOUT_S=20``): the CLI
reads them once per command (:meth:`Settings.from_env`) and a bad value is the user's
``[error]`` before anything starts. A library caller (``moe_hang.check``, a test) passes its
own, or gets the defaults. What is *not* here: the CLI's own options (``--stall``,
``--hang-after``: config.py and cli.py), the thresholds that decide a verdict
(``analysis/``), and the probe's settings (it runs inside the user's ranks, stdlib only, and
the watcher hands it its environment).

Stdlib only: every layer may take one.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from moe_hang.errors import MoeHangError

ENV_PREFIX = "MOE_HANG_"
# names the variables had before they were fields here: still read (the new name wins)
ALIASES = {"MOE_HANG_PYSPY_TIMEOUT": "pyspy_timeout_s"}


@dataclass(frozen=True)
class Settings:
    # -- capture: reading live ranks (capture/). Every wait is bounded, so a rank that does
    # not answer is a rank "unknown" with the reason, never a tool that hangs.

    # py-spy per rank, all ranks at once: a stopped or huge process takes a few seconds
    pyspy_timeout_s: float = 10.0
    # a probe answers a dump request from its own thread within milliseconds, even while
    # its rank blocks in a collective (its first dump with call sites: seconds of CPU on a
    # loaded machine); one silent this long, and still silent when py-spy is done reading
    # the stacks (at most pyspy_timeout_s more), is reported as not answering
    dump_timeout_s: float = 5.0
    # between the py-spy samples of one window: four of them span about a second, enough
    # for a rank that moves to be seen in two places
    sample_interval_s: float = 0.25
    # what RAS waits for each peer while it gathers (``ncclras -t``; NCCL's default): an int,
    # as RAS takes it
    ras_timeout_s: int = 5
    # between the two RAS reports that tell a frozen job from a moving one
    ras_interval_s: float = 3.0
    # one RAS query in all: RAS's own per-peer wait (5 s) and a margin for the transfer
    ras_query_deadline_s: float = 8.0

    # -- post-mortem: torch's dump files (evidence/flight_recorder/load_sets.py)

    # a worker process that returns no chunk of files in this long (plus the next field per
    # MB of the chunk) has stalled: the load is refused rather than waited on forever
    fr_load_timeout_s: float = 120.0
    fr_load_s_per_mb: float = 0.5

    # -- watch: the monitor's loop (runtime/monitor.py) and the end of a watched job

    # the probe beats every 0.25 s: a heartbeat silent this long means its rank's
    # interpreter holds the GIL (a long GC, teardown), and its CPU decides whether it moves
    beat_stale_s: float = 1.0
    # nothing says how many ranks run on this node (one srun or mpirun task per node that
    # starts its node's ranks itself): they are all up once no new one joined for this long
    settle_s: float = 1.0
    # every rank gone, the launcher still up: its own teardown may take this long before
    # watch ends it (a torchrun agent whose store host left first waits on it)
    launcher_teardown_s: float = 20.0
    # repro/verify: no rank of the scenario's job up after this long (torchrun could not
    # start it: a cold import on a slow filesystem takes tens of seconds) is a tool error
    startup_s: float = 180.0
    # verify --fixed: the built-in model's single-process reference, from "compare" to its
    # report (it computed while the ranks ran: a second or two)
    reference_s: float = 120.0

    # -- diagnose (commands/diagnose.py)

    # a rank gone while we looked: this long for the whole job to end too (the ranks of a
    # job that finishes exit within a second or two of each other)
    ending_wait_s: float = 3.0

    # -- multi-node: the watchers' channel and rounds (commands/multinode/, runtime/coord/)

    # the job's store appears when the head node's agent starts, whenever that is: keep
    # trying for as long as a job may queue
    store_connect_s: float = 24 * 3600.0
    # the store's node names the relay before its ranks are up; the others wait this long
    # for it once theirs are (none: no watcher there, and they stay on the job's store)
    relay_wait_s: float = 10.0
    # reaching the relay once it is named: it is up already, on a node that answers
    relay_connect_s: float = 5.0
    # the relay server's own timeout for a client's blocking operation: longer than any
    # wait of a round
    relay_op_timeout_s: float = 30.0
    # the relay gone: how long to try the job's store again (it may have gone too)
    store_fallback_s: float = 5.0
    # diagnose: an older periodic summary of another node says nothing about now
    summary_fresh_s: float = 30.0
    # a rank that moved this recently is "moving" in its node's summary (and never more
    # than half of --stall, so a rank that just entered the collective is not "computing")
    summary_moving_s: float = 5.0
    # how often the watch loop hands a fresh summary to the coordinator
    summary_offer_s: float = 1.0
    # a rank that raised is held (its probe waits) until the round is over: a whole round is
    # bounded by its capture (30 s), verdict (20 s) and end (15 s) waits, plus the capture
    hold_s: float = 90.0
    # a round asked for while the channel is still being opened (a rank raised early): wait
    # this long for it rather than give a verdict of this node's ranks only
    round_ready_s: float = 15.0
    # a rank here died and its launcher is tearing the node down: how long the capture
    # waits for the launcher's failure report (each rank's exit code)
    launcher_report_s: float = 5.0
    # closing: how long the channel's background thread may take to leave a store connect
    channel_join_s: float = 10.0

    # -- the screen (report/status.py)

    # the job wrote nothing for this long: the status line may come back under its output
    status_quiet_s: float = 0.3
    # the spinner's frame rate: often enough to look alive, rarely enough to cost nothing
    status_tick_s: float = 0.1

    # -- checks before a run (config.py)

    # --backend nccl asks a short subprocess to import torch and count GPUs: a cold import
    # on a shared filesystem takes tens of seconds
    gpu_check_timeout_s: float = 60.0

    def moving_within(self, stall_s: float) -> float:
        """A rank that moved this recently is moving now: ``summary_moving_s``, never more
        than half of --stall."""
        return min(self.summary_moving_s, stall_s / 2)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            _check(getattr(self, f.name), f.name, whole=_whole(f))

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Settings:
        """The defaults, with every ``MOE_HANG_<FIELD>`` (and alias) in ``env`` applied;
        raises :class:`MoeHangError` naming the variable for a value that is not a positive
        number."""
        given: dict[str, tuple[str, str]] = {}  # field -> (variable, text)
        for var, name in ALIASES.items():
            if var in env:
                given[name] = (var, env[var])
        for name in env_names():
            var = env_var(name)
            if var in env:
                given[name] = (var, env[var])
        whole = {f.name: _whole(f) for f in dataclasses.fields(cls)}
        values: dict[str, Any] = {name: _parse(var, text, whole=whole[name])
                                  for name, (var, text) in given.items()}
        return cls(**values)


def env_var(name: str) -> str:
    """The variable that overrides field ``name``."""
    return ENV_PREFIX + name.upper()


def env_names() -> list[str]:
    """Every field, in the order of the class."""
    return [f.name for f in dataclasses.fields(Settings)]


def _parse(var: str, text: str, *, whole: bool) -> float | int:
    raw = text.strip()
    try:
        value: float | int = int(raw) if whole else float(raw)
    except ValueError:
        kind = "a whole number of seconds" if whole else "a number of seconds"
        raise MoeHangError(f"{var}={text!r}: not {kind}") from None
    _check(value, f"{var}={text!r}", whole=whole)
    return value


def _whole(f: dataclasses.Field[Any]) -> bool:
    """An ``int`` field (``from __future__ import annotations``: its type is a string)."""
    return f.type in (int, "int")


def _check(value: object, shown: str, *, whole: bool) -> None:
    """A wait is a positive, finite number of seconds (a bool is not a number here)."""
    kinds = (int,) if whole else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise MoeHangError(f"{shown}: not a {'whole ' if whole else ''}number of seconds "
                           f"({type(value).__name__})")
    if not (math.isfinite(value) and value > 0):
        raise MoeHangError(f"{shown}: must be a positive number of seconds")
