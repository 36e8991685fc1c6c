"""NCCL's text RAS report (``ncclras``'s default, ``STATUS`` without ``SET FORMAT json``; every
release since 2.24) -> a :class:`RasReport` — pure.

The text is a summary written for a person (``client_support.cc``, ``rasClientRunInit`` and
``rasClientRunComms``): a job summary, one table row per group of similar communicators, then
``Errors`` and ``Warnings`` blocks. A communicator appears by hash only in a block (``#0-0
(27a079b828ff1a75) MISMATCH``), and ranks are named only for outlier groups (at most 10 ranks
and at most 25 % of the communicator; ``-v``: under 50 %). So each communicator read here is
``complete=False``: its :class:`RasCountGroup` s say how many ranks launched how many operations,
and which ranks when NCCL named them. NCCL 2.26 broke the counts down per operation ("different
AllReduce operation counts"); 2.24 and 2.25 count all collectives together
(:data:`ALL_COLLECTIVES`), and say UNKNOWN where 2.26 says NOCOMM.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from moe_hang.evidence.ras.records import (
    ALL_COLLECTIVES,
    RankState,
    RasCommunicator,
    RasCountGroup,
    RasGroupRow,
    RasMissingRank,
    RasProcess,
    RasRank,
    RasReport,
    RasReportError,
    RasStatusGroup,
)

_VERSION = re.compile(r"^NCCL version (\S+)")
_CUDA = re.compile(r"^CUDA runtime version (-?\d+), driver version (-?\d+)")
_COMMS = re.compile(r"^Communicators\.\.\.(?: \((\d+(?:\.\d+)?)s\))?")
_ROW = re.compile(r"^\s*(\d+)\s+(\d+)\s+(\d+)\s+(\d+(?:-\d+)?)\s+(\d+)\s+(\d+)\s+([A-Z]+)"
                  r"\s+([A-Z,]+)\s*$")
_BLOCK = re.compile(r"^#(\d+)-(\d+) \(([0-9a-fA-F]+)\) (INCOMPLETE|ERROR|MISMATCH)\s*$")
_GPU = r"GPU (\d+)(?: \(NVML (\d+)\))? managed by process (\d+) on node (\S+)"
_RANK_AT = re.compile(r"^Rank (\d+) -- " + _GPU + r"$")
_REPORTED_1 = re.compile(r"^Rank (\d+) reported (.+?) -- " + _GPU + r"$")
_RANK_UNFOUND = re.compile(r"^Rank (\d+)(?: .*)? -- \[process information not found\]$")
_LAUNCHED_N = re.compile(r"^(\d+) ranks have launched up to operation (\d+)$")
_NONE_N = re.compile(r"^(\d+) ranks have not launched any operations$")
_LAUNCHED_1 = re.compile(r"^Rank (\d+) has launched up to operation (\d+)(?: -- " + _GPU + r")?")
_NONE_1 = re.compile(r"^Rank (\d+) has not launched any operations(?: -- " + _GPU + r")?")
_COUNTS_OF = re.compile(r"^Communicator ranks have different (\w+) operation counts$")
_STATUS_N = re.compile(r"^(\d+) ranks have status ([A-Z]+)$")
_STATUS_1 = re.compile(r"^Rank ([\d,]+) has status ([A-Z]+)(?: -- " + _GPU + r")?")
_UNKNOWN_RANKS = re.compile(r"^The unknown ranks: ([\d,\s]+)$")
_MISSING_LIST = re.compile(r"^The missing ranks?: ([\d,\s]+)$")
_PROCESS = re.compile(r"^Process (\d+) on node (\S+) managing GPUs? (.+)$")
_TIMEOUTS = re.compile(r"^Encountered (\d+) communication timeouts?")
_JOB_ROW5 = re.compile(r"^\s*(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s*$")


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", text))


@dataclass
class _Comm:
    """A communicator being assembled from the blocks that name it."""

    group: int
    index: int
    hash: str
    ranks: dict[int, RasRank] = field(default_factory=dict)
    missing: dict[int, RasMissingRank] = field(default_factory=dict)
    counts: list[RasCountGroup] = field(default_factory=list)
    states: list[RasStatusGroup] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    error_ranks: list[int] = field(default_factory=list)


class _Parser:
    def __init__(self) -> None:
        self.version = ""
        self.cuda: tuple[int, int] | None = None
        self.collection: float | None = None
        self.rows: list[RasGroupRow] = []
        self.comms: dict[str, _Comm] = {}
        self.missing_procs: list[RasProcess] = []
        self.dead_procs: list[RasProcess] = []
        self.timeouts = 0
        self.seen_comms = False
        self.block = ""  # INCOMPLETE / DEAD / TIMEOUT (job level) or MISMATCH / ... of a comm
        self.comm: _Comm | None = None
        self.op = ""  # the op of the count groups being read
        self.open_group: list[int] | None = None  # members of the last "N ranks ..." line
        self.open_kind = ""

    def line(self, raw: str) -> None:
        s = raw.strip()
        if not s or set(s) == {"="}:
            return
        if raw[:1] not in (" ", "\t"):
            self.top(s)
        else:
            self.inner(s)

    def top(self, s: str) -> None:
        self.open_group = None
        if m := _VERSION.match(s):
            self.version = m.group(1)
        elif m := _CUDA.match(s):
            self.cuda = (int(m.group(1)), int(m.group(2)))
        elif m := _COMMS.match(s):
            self.seen_comms = True
            self.collection = float(m.group(1)) if m.group(1) else None
        elif m := _BLOCK.match(s):
            g, i, h, kind = int(m.group(1)), int(m.group(2)), m.group(3), m.group(4)
            key = f"0x{int(h, 16):016x}"
            self.comm = self.comms.setdefault(key, _Comm(g, i, key))
            self.block = kind
        elif s in ("INCOMPLETE", "DEAD", "TIMEOUT"):
            self.comm, self.block = None, s
        elif s in ("Errors", "Warnings", "Job summary"):
            self.comm, self.block = None, ""
        elif s.startswith("No communicator data collected"):
            self.seen_comms = True
        elif self.seen_comms and (m := _ROW.match(s)) and self.comm is None:
            self.row(m)

    def row(self, m: re.Match[str]) -> None:
        self.rows.append(RasGroupRow(group=int(m.group(1)), comms=int(m.group(2)),
                                     nodes_per_comm=int(m.group(3)),
                                     ranks_per_node=m.group(4), ranks_per_comm=int(m.group(5)),
                                     ranks_in_group=int(m.group(6)), state=m.group(7),
                                     errors=m.group(8)))

    def inner(self, s: str) -> None:
        if self.seen_comms and self.comm is None and not self.block and (m := _ROW.match(s)):
            self.row(m)  # rows are indented by %5d
        elif self.comm is None:
            self.job_level(s)
        elif self.block == "MISMATCH":
            self.mismatch(self.comm, s)
        elif self.block == "INCOMPLETE":
            self.incomplete(self.comm, s)
        elif self.block == "ERROR":
            self.comm.errors.append(s)
            if m := _REPORTED_1.match(s):
                r: int | None = int(m.group(1))
                g = m.groups()[-4:]
                self.add_rank(self.comm, int(m.group(1)), g[0], g[1], g[2], g[3], {}, None)
            else:
                r = self.rank_line(self.comm, s, {})
            if r is not None and r not in self.comm.error_ranks:
                self.comm.error_ranks.append(r)

    def job_level(self, s: str) -> None:
        if (m := _PROCESS.match(s)) and self.block in ("INCOMPLETE", "DEAD"):
            proc = RasProcess(pid=int(m.group(1)), host=m.group(2), gpus=m.group(3))
            (self.dead_procs if self.block == "DEAD" else self.missing_procs).append(proc)
        elif (m := _TIMEOUTS.match(s)) and self.block == "TIMEOUT":
            self.timeouts = int(m.group(1))

    def rank_line(self, c: _Comm, s: str, counts: dict[str, int],
                  state: RankState | None = None) -> int | None:
        """A ``Rank N -- GPU g managed by process p on node h`` line: the rank, recorded."""
        if m := _RANK_AT.match(s):
            r = int(m.group(1))
            self.add_rank(c, r, m.group(2), m.group(3), m.group(4), m.group(5), counts, state)
            return r
        if m := _RANK_UNFOUND.match(s):
            return int(m.group(1))
        return None

    def add_rank(self, c: _Comm, r: int, cuda: str | None, nvml: str | None, pid: str | None,
                 host: str | None, counts: dict[str, int], state: RankState | None) -> None:
        old = c.ranks.get(r)
        merged = dict(old.collective_counts) if old else {}
        merged.update(counts)
        cd = int(cuda) if cuda else (old.cuda_dev if old else -1)
        c.ranks[r] = RasRank(rank=r, host=host or (old.host if old else "unknown"),
                             pid=int(pid) if pid else (old.pid if old else -1), cuda_dev=cd,
                             nvml_dev=int(nvml) if nvml else cd, collective_counts=merged,
                             state_hint=state or (old.state_hint if old else None))

    def mismatch(self, c: _Comm, s: str) -> None:
        if s == "Communicator ranks have different status":
            self.open_kind, self.open_group = "status", None
        elif s == "Communicator ranks have different collective operation counts":
            self.op, self.open_kind, self.open_group = ALL_COLLECTIVES, "count", None
        elif m := _COUNTS_OF.match(s):
            self.op, self.open_kind, self.open_group = m.group(1), "count", None
        elif (m := _LAUNCHED_N.match(s)) or (m := _NONE_N.match(s)):
            count = int(m.group(2)) if m.re is _LAUNCHED_N else 0
            c.counts.append(RasCountGroup(self.op, count, int(m.group(1))))
            self.open_group = []
        elif (m := _LAUNCHED_1.match(s)) or (m := _NONE_1.match(s)):
            count = int(m.group(2)) if m.re is _LAUNCHED_1 else 0
            r = int(m.group(1))
            g = m.groups()[-4:]
            self.add_rank(c, r, g[0], g[1], g[2], g[3], {self.op: count}, None)
            c.counts.append(RasCountGroup(self.op, count, 1, (r,)))
            self.open_group = None
        elif m := _STATUS_N.match(s):
            c.states.append(RasStatusGroup(RankState(m.group(2)), int(m.group(1))))
            self.open_group = []
        elif m := _STATUS_1.match(s):
            st = RankState(m.group(2))
            ranks = _ints(m.group(1))
            for r in ranks:
                g = m.groups()[-4:]
                self.add_rank(c, r, g[0], g[1], g[2], g[3], {}, st)
            c.states.append(RasStatusGroup(st, len(ranks), ranks))
            self.open_group = None
        elif m := _UNKNOWN_RANKS.match(s):
            if c.states and c.states[-1].state is RankState.UNKNOWN:
                last = c.states.pop()
                c.states.append(RasStatusGroup(last.state, last.n_ranks, _ints(m.group(1))))
        elif self.open_group is not None:
            self.member(c, s)

    def member(self, c: _Comm, s: str) -> None:
        """A rank listed under the last "N ranks have ..." line."""
        assert self.open_group is not None
        if self.open_kind == "count" and c.counts:
            last = c.counts[-1]
            r = self.rank_line(c, s, {last.op: last.count})
            if r is not None:
                c.counts[-1] = RasCountGroup(last.op, last.count, last.n_ranks,
                                             (*last.ranks, r))
        elif self.open_kind == "status" and c.states:
            st = c.states[-1]
            r = self.rank_line(c, s, {}, st.state)
            if r is not None:
                c.states[-1] = RasStatusGroup(st.state, st.n_ranks, (*st.ranks, r))

    def incomplete(self, c: _Comm, s: str) -> None:
        if m := _MISSING_LIST.match(s):
            for r in _ints(m.group(1)):
                c.missing.setdefault(r, RasMissingRank(r, "unknown", -1, -1, -1, True, False))
        elif m := _RANK_AT.match(s):
            r, cuda, nvml = int(m.group(1)), int(m.group(2)), m.group(3)
            c.missing[r] = RasMissingRank(r, m.group(5), int(m.group(4)), cuda,
                                          int(nvml) if nvml else cuda, True, False)
        elif m := _RANK_UNFOUND.match(s):
            r = int(m.group(1))
            c.missing.setdefault(r, RasMissingRank(r, "unknown", -1, -1, -1, True, False))

    def report(self) -> RasReport:
        dead = {(p.host, p.pid) for p in self.dead_procs}
        sizes = {row.group: row.ranks_per_comm for row in self.rows}
        comms = []
        for c in self.comms.values():
            missing = tuple(RasMissingRank(m.rank, m.host, m.pid, m.cuda_dev, m.nvml_dev, True,
                                           (m.host, m.pid) in dead)
                            for _, m in sorted(c.missing.items()))
            comms.append(RasCommunicator(
                hash=c.hash, size=sizes.get(c.group, 0),
                ranks=tuple(r for _, r in sorted(c.ranks.items())), missing_ranks=missing,
                complete=False, label=f"#{c.group}-{c.index}", count_groups=tuple(c.counts),
                status_groups=tuple(c.states), errors=tuple(c.errors),
                error_ranks=tuple(c.error_ranks)))
        return RasReport(fmt="text", nccl_version=self.version, communicators=tuple(comms),
                         cuda_runtime_version=self.cuda[0] if self.cuda else None,
                         cuda_driver_version=self.cuda[1] if self.cuda else None,
                         collection_time_s=self.collection, timeouts=self.timeouts,
                         missing_processes=tuple(self.missing_procs),
                         dead_processes=tuple(self.dead_procs), groups=tuple(self.rows))


def parse_text_report(text: str) -> RasReport:
    """The text report -> :class:`RasReport` (raises :class:`RasReportError`)."""
    p = _Parser()
    for raw in text.splitlines():
        p.line(raw.rstrip("\r"))
    if not p.seen_comms:
        raise RasReportError("no 'Communicators...' section: not a RAS status report")
    return p.report()
