"""Every file name of a run directory, in one place (stdlib only: the probe inside each rank
loads this file too, in whatever Python environment the job runs).

A run directory (repro, verify, watch, diagnose --out) looks the same for every command, so
``moe-hang analyze`` can read any of them (docs/DESIGN.md §7)::

    meta.json  config.json  processes.json  diagnosis.json  console.log  job.log
    reference.json  reference.log  reference.routing.jsonl (the reference's router counts)
    torchrun/
    ranks/rank{R}.hb.json       heartbeat              ranks/rank{R}.fr.pkl      Flight Recorder
    ranks/rank{R}.fr.saved.pkl  the recorder, saved every few seconds (what a SIGABRT leaves)
    ranks/rank{R}.posted.jsonl  every collective the rank posted, kept past its end (history.py)
    ranks/rank{R}.tokens.jsonl  posted collectives     ranks/rank{R}.stack.txt   faulthandler
    ranks/rank{R}.fatal.txt     fatal-signal stack     ranks/rank{R}.error.json  exception
    ranks/rank{R}.thread_errors.json  exceptions that ended one of its threads (not the rank)
    ranks/rank{R}.groups.json   process groups         ranks/rank{R}.dump.json   dump marker
    ranks/rank{R}.ctl           the probe's FIFO       ranks/rank{R}.dump.err    dump failed
    ranks/rank{R}.coverage.json LoRA coverage          ranks/rank{R}.result.pt   verify's results
    ranks/rank{R}.routing.jsonl tokens per expert per router call, the last two steps
    stacks/rank{R}.pyspy.json   py-spy --json          stacks/rank{R}.pyspy.err  why not
    ranks/hold.json             multi-node watch: hold a rank that raised for the capture
    coord/verdict.json  coord/local-diagnosis.json  coord/analysis.json  .capture/  teardown/
    coord/nodes/<node>/  the other nodes' captures     (multi-node watch)
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

_RANK_FILE = re.compile(r"rank(\d+)\.")
HOLD = "hold.json"


@dataclass(frozen=True)
class RankFiles:
    """The files of one rank: what its probe writes under ``ranks/`` and what the tool writes
    about it under ``stacks/``."""

    ranks_dir: Path
    rank: int

    # what follows ``ranks/rank{R}.``: RunLayout.files_of takes these
    HEARTBEAT = "hb.json"
    FR = "fr.pkl"
    FR_SAVED = "fr.saved.pkl"  # the recorder as the probe saved it last (survives an abort)
    POSTED = "posted.jsonl"  # the recorder's entries as the probe copied them (probe/history.py)
    TOKENS = "tokens.jsonl"
    STACK = "stack.txt"
    FATAL = "fatal.txt"
    ERROR = "error.json"
    THREAD_ERRORS = "thread_errors.json"  # exceptions that ended a thread, not the rank
    GROUPS = "groups.json"
    DUMP_MARKER = "dump.json"
    DUMP_ERROR = "dump.err"
    CTL = "ctl"
    COVERAGE = "coverage.json"
    RESULT = "result.pt"
    ROUTING = "routing.jsonl"  # MoE routers' token counts (probe/routing.py)
    PYSPY = "pyspy.json"  # in stacks/, as the next two
    PYSPY_ERROR = "pyspy.err"
    HELPERS = "helpers.json"

    def in_ranks(self, suffix: str) -> Path:
        """Its file of that name in ranks/ (``hb.json``: ``ranks/rank{R}.hb.json``)."""
        return self.ranks_dir / f"rank{self.rank}.{suffix}"

    def in_stacks(self, suffix: str) -> Path:
        """Its file of that name in stacks/ (``pyspy.json``)."""
        return self.ranks_dir.parent / "stacks" / f"rank{self.rank}.{suffix}"

    @property
    def prefix(self) -> Path:
        return self.ranks_dir / f"rank{self.rank}"

    @property
    def heartbeat(self) -> Path:
        return self.in_ranks(self.HEARTBEAT)

    @property
    def fr(self) -> Path:
        return self.in_ranks(self.FR)

    @property
    def fr_saved(self) -> Path:
        return self.in_ranks(self.FR_SAVED)

    @property
    def posted(self) -> Path:
        return self.in_ranks(self.POSTED)

    @property
    def tokens(self) -> Path:
        return self.in_ranks(self.TOKENS)

    @property
    def routing(self) -> Path:
        return self.in_ranks(self.ROUTING)

    @property
    def stack(self) -> Path:
        return self.in_ranks(self.STACK)

    @property
    def fatal(self) -> Path:
        return self.in_ranks(self.FATAL)

    @property
    def error(self) -> Path:
        return self.in_ranks(self.ERROR)

    @property
    def thread_errors(self) -> Path:
        return self.in_ranks(self.THREAD_ERRORS)

    @property
    def groups(self) -> Path:
        return self.in_ranks(self.GROUPS)

    @property
    def dump_marker(self) -> Path:
        return self.in_ranks(self.DUMP_MARKER)

    @property
    def dump_error(self) -> Path:
        return self.in_ranks(self.DUMP_ERROR)

    @property
    def ctl(self) -> Path:
        return self.in_ranks(self.CTL)

    @property
    def coverage(self) -> Path:
        return self.in_ranks(self.COVERAGE)

    @property
    def result(self) -> Path:
        return self.in_ranks(self.RESULT)

    @property
    def pyspy(self) -> Path:
        return self.in_stacks(self.PYSPY)

    @property
    def pyspy_error(self) -> Path:
        return self.in_stacks(self.PYSPY_ERROR)

    @property
    def helpers(self) -> Path:
        """py-spy of the rank's own child processes (DataLoader workers, ...), by pid."""
        return self.in_stacks(self.HELPERS)

    @property
    def hold(self) -> Path:
        """One for every rank: the watcher's order to hold a rank that raised until the
        capture round is over (multi-node watch; ``{"watcher": pid, "limit_s": s}``)."""
        return self.ranks_dir / HOLD

    def probe_files(self) -> tuple[Path, ...]:
        """What a live probe leaves behind (copied by ``diagnose`` from a job under watch)."""
        return (self.heartbeat, self.fr, self.stack, self.groups, self.tokens, self.fatal,
                self.error, self.dump_marker, self.posted, self.routing)


@dataclass(frozen=True)
class RunLayout:
    """The file names of one run directory."""

    root: Path

    @property
    def meta(self) -> Path:
        return self.root / "meta.json"

    @property
    def config(self) -> Path:
        return self.root / "config.json"

    @property
    def processes(self) -> Path:
        return self.root / "processes.json"

    @property
    def diagnosis(self) -> Path:
        return self.root / "diagnosis.json"

    @property
    def watched(self) -> Path:
        """Each capture watch made and watched on (an uncertain stall, a capture that saw the
        ranks move, one on request): the line it said, the whole diagnosis and where its
        capture is kept (``watched_dir``), one per line."""
        return self.root / "watched.jsonl"

    @property
    def watched_dir(self) -> Path:
        """``watched/<n>/``: the n-th of those captures, a run directory ``analyze`` reads."""
        return self.root / "watched"

    @property
    def source(self) -> Path:
        """What the job's source says of the capture's lines, read when it was made."""
        return self.root / "source.json"

    @property
    def console_log(self) -> Path:
        return self.root / "console.log"

    @property
    def job_log(self) -> Path:
        return self.root / "job.log"

    @property
    def reference(self) -> Path:
        return self.root / "reference.json"

    @property
    def reference_log(self) -> Path:
        return self.root / "reference.log"

    @property
    def reference_routing(self) -> Path:
        """The reference's own router counts (moe_hang.check with a reference)."""
        return self.root / "reference.routing.jsonl"

    @property
    def torchrun_dir(self) -> Path:
        return self.root / "torchrun"

    @property
    def ranks_dir(self) -> Path:
        return self.root / "ranks"

    @property
    def stacks_dir(self) -> Path:
        return self.root / "stacks"

    @property
    def bin_dir(self) -> Path:
        """watch's torchrun shim (runtime/shim.py), first on the job's PATH."""
        return self.root / "bin"

    @property
    def ras_dir(self) -> Path:
        """NCCL RAS reports taken at capture (``poll1.json``, ``poll2.json``: what RAS sent)."""
        return self.root / "ras"

    @property
    def ras_meta(self) -> Path:
        """How the RAS polls were taken: where, when, the interval, what failed."""
        return self.ras_dir / "polls.json"

    def ras_poll(self, i: int, fmt: str) -> Path:
        return self.ras_dir / f"poll{i}.{'json' if fmt == 'json' else 'txt'}"

    # multi-node watch: what the coordination adds (docs/DESIGN.md §10)
    @property
    def coord_dir(self) -> Path:
        return self.root / "coord"

    @property
    def coord_verdict(self) -> Path:
        """The global verdict and every node's summary."""
        return self.coord_dir / "verdict.json"

    @property
    def coord_local(self) -> Path:
        """This node's own diagnosis of its own capture."""
        return self.coord_dir / "local-diagnosis.json"

    @property
    def coord_analysis(self) -> Path:
        """On the node that analysed: the engine's verdict over every node's capture."""
        return self.coord_dir / "analysis.json"

    @property
    def coord_nodes(self) -> Path:
        """On the node that analysed: every other node's capture as it sent it, a capture
        directory each (``coord/nodes/<node>/``, moe_hang.capture.bundle)."""
        return self.coord_dir / "nodes"

    @property
    def coord_nodes_round(self) -> Path:
        """The capture request the captures in ``coord/nodes/`` answered."""
        return self.coord_nodes / "round.json"

    @property
    def snapshot_dir(self) -> Path:
        """The ranks' files as captured, while the job is being ended."""
        return self.root / ".capture"

    @property
    def teardown_dir(self) -> Path:
        """What the ranks and the job wrote after the capture."""
        return self.root / "teardown"

    @property
    def hold(self) -> Path:
        """Multi-node watch: hold a rank that raised for the capture (``RankFiles.hold``)."""
        return self.ranks_dir / HOLD

    def rank(self, r: int) -> RankFiles:
        return RankFiles(self.ranks_dir, r)

    def is_capture(self) -> bool:
        return self.ranks_dir.is_dir() or self.stacks_dir.is_dir()

    def node_captures(self) -> list[Path]:
        """The other nodes' captures this node's watcher analysed with (``coord/nodes/*``),
        where they answered the round whose verdict this directory holds (a later round
        another node analysed leaves an earlier one's here: not this verdict's)."""
        try:
            kept = json.loads(self.coord_nodes_round.read_text()).get("request")
            verdict = json.loads(self.coord_verdict.read_text()).get("request")
            found = sorted(self.coord_nodes.iterdir())
        except (OSError, ValueError, AttributeError):
            return []
        if kept is None or kept != verdict:
            return []
        return [d for d in found if RunLayout(d).is_capture()]

    def rank_numbers(self) -> set[int]:
        """Every rank with a file under ranks/ or stacks/."""
        found: set[int] = set()
        for d in (self.ranks_dir, self.stacks_dir):
            if d.is_dir():
                for p in d.iterdir():
                    m = _RANK_FILE.match(p.name)
                    if m:
                        found.add(int(m.group(1)))
        return found

    def files_of(self, suffix: str) -> list[Path]:
        """``ranks/rank*.<suffix>`` of every rank (a ``RankFiles`` constant, e.g.
        ``RankFiles.FATAL``), in name order."""
        if not self.ranks_dir.is_dir():
            return []
        return sorted(self.ranks_dir.glob(f"rank*.{suffix}"))
