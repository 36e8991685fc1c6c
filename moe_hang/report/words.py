"""What the first screen says, as plain words: how a rank ended, where each rank is, the
culprits and why, the fix, the next command (pure: no layout, no rich)."""

from __future__ import annotations

import re
import shlex
from collections.abc import Callable
from dataclasses import dataclass

from moe_hang.analysis.diagnosis import (
    CulpritBasis,
    Diagnosis,
    RankCollective,
    RankReport,
    Verdict,
    fmt_shape,
    pg_label,
)
from moe_hang.analysis.runs import ScenarioRun
from moe_hang.evidence.rankid import is_unidentified, pid_of
from moe_hang.evidence.stacks import Frame, is_stdlib_frame
from moe_hang.evidence.vocab import RankState, exit_desc, who
from moe_hang.report.wrap import display_path, shorten_paths

MAX_SITE_GROUPS = 4  # more distinct lines: merged by size, then folded into "… and N more"


# why the culprit is the culprit, in words (CulpritBasis, docs/DESIGN.md §8): one culprit,
# several
BASIS_WORDS: dict[str, tuple[str, str]] = {
    CulpritBasis.EXCEPTION: ("it raised the first exception", "they raised the exceptions"),
    CulpritBasis.EXITED: ("it died or left while the others wait for it",
                          "they died or left while the others wait for them"),
    CulpritBasis.MAJORITY: ("it differs from the majority at the divergence",
                            "they differ from the majority at the divergence"),
    CulpritBasis.PROGRAM_ORDER: ("it went past what the others wait in",
                                 "they went past what the others wait in"),
    # the order, a shape, or a helper thread's rate (one per lap): what the steps kept
    CulpritBasis.HISTORY: ("it broke what its earlier iterations kept",
                           "they broke what their earlier iterations kept"),
    CulpritBasis.CYCLE: ("it waits in a cycle", "they wait for each other in a cycle"),
    CulpritBasis.SOURCE: ("a rank condition in the source sets it apart",
                          "a rank condition in the source sets them apart"),
    CulpritBasis.WAITED_FOR: ("the others wait for it outside any collective",
                              "the others wait for them outside any collective"),
    CulpritBasis.THREAD_ORDER: ("its threads post on one group in an order timing sets",
                                "their threads post on one group in an order timing sets"),
    CulpritBasis.AMBIGUOUS: ("the evidence does not decide",
                             "the evidence does not decide between them"),
    CulpritBasis.NCCL_ERROR: ("NCCL reports an error on it", "NCCL reports errors on them"),
    CulpritBasis.LAUNCH_COUNTS: ("it never launched what the others launched",
                                 "they never launched what the others launched"),
    CulpritBasis.KERNEL_TIMING: ("its kernel started last, or never: look there first",
                                 "their kernels started last, or never: look there first"),
}


@dataclass(frozen=True)
class ReportContext:
    """What the command knows that the diagnosis does not."""

    command: str  # repro | verify | watch | diagnose | analyze
    title: str  # "moe-hang verify --fixed", "moe-hang diagnose 1234"
    next_command: list[str] | None = None  # repro: verify --fixed with the user's options


def exit_words(code: int | None) -> str:
    return "exited" if code is None else exit_desc(code)


def timing_parts(d: Diagnosis) -> list[str]:
    """``wall 8.0 s``, ``hang onset → verdict 1.24 s``, ``rule ...``: the footer's start."""
    tm = d.timings
    parts = []
    if tm is not None and tm.wall_s is not None:
        parts.append(f"wall {tm.wall_s:.1f} s")
    if tm is not None and tm.onset_to_verdict_s is not None:
        parts.append(f"hang onset → verdict {tm.onset_to_verdict_s:.2f} s")
    if d.rule:
        parts.append(f"rule {d.rule}")
    return parts


def tokens_text(t: dict[str, object] | None) -> str:
    """``68 local · experts 37/37/29/33 · gathered 68/401 · from_local assumes 68/68``: the
    routing a rank logged (the same words on the console and in the HTML)."""
    if not t:
        return ""

    def joined(key: str) -> str:
        v = t.get(key)
        return "/".join(map(str, v)) if isinstance(v, list) else str(v)

    parts = [f"{t.get('local')} local"]
    for key, label in (("per_expert", "experts"), ("gathered_lengths", "gathered"),
                       ("assumed_lengths", "from_local assumes")):
        if t.get(key) is not None:
            parts.append(f"{label} {joined(key)}")
    return " · ".join(parts)


def site_text(site: Frame | None) -> str:
    return f"{display_path(site.file)}:{site.line} {site.function}" if site else "-"


def collective_text(c: RankCollective, *, sizes: bool = True) -> str:
    """``all_gather default_pg#1 [68×64]`` (a collective known only from a stack: its op)."""
    if c.op == "unknown" and c.from_stack_only:
        return "a wait on a collective posted earlier"
    if c.from_stack_only:
        return c.op
    seq = f"#{c.seq}" if c.seq is not None else ""
    if c.op in ("send", "recv"):
        seq = f" p2p{seq}"  # a group's send/recv count, not its collective sequence number
    shape = fmt_shape(c.input_sizes) if sizes else ""
    started = " (kernel started)" if c.state == "started" else ""  # recorder timing only
    return f"{c.op} {pg_label(c.pg, c.pg_desc, word='pg')}{seq}" + (f" [{shape}]" if shape
                                                                    else "") + started


# a file named after its rank (comm_lib_trace_rank_1, rank1.fr.pkl) in front of what failed
_RANK_FILE = re.compile(r"\b[\w.-]*rank_?\d+\b[\w.-]*: ")


def unknown_why(d: Diagnosis, rank: int) -> str | None:
    """Why nothing is known of a rank, from the evidence said about it (``rank 1: Flight
    Recorder dump unreadable (comm_lib_trace_rank_1: truncated or corrupt pickle ...)``): an
    unreadable file first; the file's own name left out (the rank says whose it is), so ranks
    whose files failed alike are one group."""
    prefix = f"rank {rank}: "
    said = [e[len(prefix):] for e in d.evidence if e.startswith(prefix)]
    if not said:
        return None
    return _RANK_FILE.sub("", next((e for e in said if "unreadable" in e), said[0])).strip()


_STACK_ENTRY = re.compile(r"^(?P<file>.+):(?P<line>\d+) (?P<function>\S+)$")
_STDLIB_DIR = re.compile(r"^.*?/lib/python\d+(?:\.\d+)?t?/")


def library_frame(r: RankReport) -> str | None:
    """``ctypes/__init__.py:519 string_at``: the frame of Python's own library a rank ended
    inside, called from its line (the line leads; this follows it); None otherwise."""
    if r.state != RankState.EXITED or r.callsite is None or not r.stack:
        return None
    m = _STACK_ENTRY.match(r.stack[0])
    if m is None:
        return None
    top = Frame(m["file"], int(m["line"]), m["function"])
    if not is_stdlib_frame(top) or (top.file, top.line) == (r.callsite.file, r.callsite.line):
        return None
    return f"{_STDLIB_DIR.sub('', top.file.replace(chr(92), '/'))}:{top.line} {top.function}"


def where_now(r: RankReport, *, sizes: bool = True, why: str | None = None) -> str:
    """Where a rank is, in a few words; ``why``: why its state is unknown, where its report
    has no note that says it."""
    at = f" at {site_text(r.callsite)}" if r.callsite else ""
    if r.state == RankState.IN_COLLECTIVE and r.collective is not None:
        return f"in {collective_text(r.collective, sizes=sizes)}{at}"
    if r.state == RankState.EXITED:
        inside = library_frame(r)
        if r.callsite and r.stack_source == "probe":
            # a sample of its heartbeat while it ran, not where it died (a SIGKILL leaves
            # no stack)
            return exit_words(r.exit_code) + f" (last seen at {site_text(r.callsite)})"
        return exit_words(r.exit_code) + at + (f" (in {inside})" if inside else "")
    if r.state == RankState.IDLE and r.note and not r.callsite:
        return r.note  # from dumps alone: where it was instead, only a stack says
    if r.state in (RankState.COMPUTING, RankState.IDLE):
        return f"{r.state}{at}"
    if not r.note and why:
        return f"state unknown: {why}" + at
    return "state unknown" + (f" ({r.note})" if r.note else "") + at


def _collective_at(d: Diagnosis, rank: int) -> RankCollective | None:
    """The collective a rank is shown with: its own at the divergence, else its current."""
    fd = d.first_divergence
    if fd is not None and rank in fd.per_rank:
        return fd.per_rank[rank]
    rep = d.rank(rank)
    return rep.collective if rep is not None and rep.state == RankState.IN_COLLECTIVE else None


def rank_phrase(d: Diagnosis, rank: int, *, sizes: bool = True) -> str:
    """What one rank did at the divergence (else where it is now)."""
    rep = d.rank(rank)
    fd = d.first_divergence
    if fd is not None and rank in fd.per_rank:
        c = fd.per_rank[rank]
        if c is not None:
            site = c.callsite or (rep.callsite if rep else None)
            # how it ended (killed by SIGABRT) is the summary's and the detail's to say
            at = f" at {site_text(site)}" if site is not None else ""
            now = rep.collective if rep is not None and rep.state == RankState.IN_COLLECTIVE \
                else None
            # a rank that waits in a later collective went past this one (a silent
            # mispairing): "in" it would contradict the rank table
            verb = "posted" if now is not None and (now.pg, now.seq) != (c.pg, c.seq) \
                and now.seq is not None and c.seq is not None else "in"
            return f"{verb} {collective_text(c, sizes=sizes)}{at}"
        posted = next((x for x in fd.per_rank.values() if x is not None), None)
        # the others' sizes may differ from each other: the op and the seq say which one
        what = collective_text(posted, sizes=False) if posted is not None else "the collective"
        if posted is not None and posted.seq is None and posted.callsite is not None:
            what += f" at {site_text(posted.callsite)}"  # no number: the line says which
        if fd.phase == "p2p" and posted is not None:  # its side of a send/recv: the other op
            what = f"the {'send' if posted.op == 'recv' else 'recv'} for {what}"
        return f"never posted {what}; " + (where_now(rep, sizes=sizes,
                                                     why=unknown_why(d, rank)) if rep
                                           else "nothing known")
    return where_now(rep, sizes=sizes, why=unknown_why(d, rank)) if rep is not None \
        else "nothing known"


def rank_site(d: Diagnosis, r: int) -> Frame | None:
    """Where rank ``r`` posted the diverging collective, else where it is now."""
    c = d.first_divergence.per_rank.get(r) if d.first_divergence is not None else None
    rep = d.rank(r)
    return (c.callsite if c is not None else None) or (rep.callsite if rep else None)


def culprit_site(d: Diagnosis) -> tuple[int, Frame] | None:
    """The line to open: where the (first) culprit posted the diverging collective, else
    where it is now."""
    return next(((r, site) for r in sorted(d.culprit_ranks)
                 if (site := rank_site(d, r)) is not None), None)


def culprit_words(d: Diagnosis) -> tuple[str, str, str] | None:
    """(label, ranks, why) of the culprit line; None when there is nobody to blame."""
    if not d.culprit_ranks or d.verdict == Verdict.HEALTHY:
        return None
    ranks = sorted(d.culprit_ranks)
    label = "culprit" if len(ranks) == 1 else "culprits"
    names = who(ranks)
    one, several = BASIS_WORDS.get(d.culprit_basis, ("", ""))
    return label, names, one if len(ranks) == 1 else several


def site_groups(d: Diagnosis, max_groups: int = MAX_SITE_GROUPS, *,
                merge_sizes: bool | None = None) -> list[tuple[list[int], str, bool]]:
    """(ranks, what they did, holds a culprit) per distinct call site, culprits first.
    ``merge_sizes`` (by default: when there are more distinct lines than ``max_groups``):
    ranks that differ only in their sizes are one group, its sizes counted, not listed."""
    if d.verdict == Verdict.HEALTHY:
        return []
    ranks = sorted({r.rank for r in d.ranks}
                   | set(d.first_divergence.per_rank if d.first_divergence else ()))
    groups = _group(ranks, lambda r: rank_phrase(d, r)) if not merge_sizes else {}
    if merge_sizes or (merge_sizes is None and len(groups) > max_groups):
        merged = _group(ranks, lambda r: rank_phrase(d, r, sizes=False))
        if merge_sizes or len(merged) < len(groups):
            groups = {}
            for phrase, members in merged.items():
                shapes = {fmt_shape(c.input_sizes) for r in members
                          if (c := _collective_at(d, r)) is not None}
                if len(shapes) > 1:
                    phrase += f" ({len(shapes)} different sizes)"
                elif len(shapes) == 1:
                    phrase = rank_phrase(d, members[0])  # one size: say it
                groups[phrase] = members
    culprits = set(d.culprit_ranks)
    out = [(members, shorten_paths(phrase), bool(culprits & set(members)))
           for phrase, members in groups.items()]
    return sorted(out, key=lambda g: (not g[2], g[0][0]))


def _group(ranks: list[int], key: Callable[[int], str]) -> dict[str, list[int]]:
    groups: dict[str, list[int]] = {}
    for r in ranks:
        groups.setdefault(key(r), []).append(r)
    return groups


def fix_words(d: Diagnosis) -> tuple[str, str, str | None] | None:
    """(label, sentence, code to paste) of the fix; None where no fix belongs on screen."""
    run = d.run if isinstance(d.run, ScenarioRun) else None
    if run is not None and run.variant == "broken" and run.verified is not None:
        return None  # a regression check: the fix is not what it is about
    if d.verdict == Verdict.HEALTHY and (run is None or run.variant != "fixed"):
        return None
    hint = (run.fix_hint if run is not None else "") or d.fix
    if not hint:
        return None
    label = "fix under test" if run is not None and run.variant == "fixed" else "fix"
    return label, shorten_paths(hint), d.fix_code or None


def next_words(d: Diagnosis, ctx: ReportContext) -> tuple[str, str] | None:
    """(what to run or open, why) of the next step; None when there is nothing to do."""
    run = d.run if isinstance(d.run, ScenarioRun) else None
    if d.verdict == Verdict.HEALTHY or (run is not None and run.verified is True):
        return None  # proven (or the regression still reproduces): nothing left to do
    if ctx.next_command:
        return shlex.join(ctx.next_command), ""
    if d.culprit_basis == CulpritBasis.AMBIGUOUS and len(d.culprit_ranks) > 1:
        return _undecided_next(d, ctx)
    found = culprit_site(d)
    if found is None:
        return None
    rank, site = found
    if d.fix_site is not None:  # the branch the fix is about, not where the culprit is now
        return (f"open {display_path(d.fix_site.file)}:{d.fix_site.line}",
                d.fix_site_why or f"the branch rank {rank} took")
    who = f"PID {pid_of(rank)}, rank unknown" if is_unidentified(rank) else f"rank {rank}"
    return f"open {display_path(site.file)}:{site.line}", f"{site.function}, {who}"


def _undecided_next(d: Diagnosis, ctx: ReportContext) -> tuple[str, str] | None:
    """The next step where the evidence does not decide between the culprits: never one of
    them picked by its number. One line for all: open it; stacks alone: the recorder's
    history decides (watch); else every line they are at."""
    sites: dict[tuple[str, int], Frame] = {}
    for r in sorted(d.culprit_ranks):
        if (site := rank_site(d, r)) is not None:
            sites.setdefault((site.file, site.line), site)
    names = who(d.culprit_ranks)
    if len(sites) == 1:
        site = next(iter(sites.values()))
        return f"open {display_path(site.file)}:{site.line}", f"{site.function}, {names}"
    if ctx.command == "diagnose":
        return ("moe-hang watch -- <the job's launch command>",
                f"the Flight Recorder history decides between {names}")
    if not sites:
        return None
    return ("open " + " and ".join(f"{display_path(f.file)}:{f.line}" for f in sites.values()),
            f"where {names} are")


def run_words(d: Diagnosis, ctx: ReportContext) -> str:
    if ctx.command == "analyze":
        return f"captures {d.artifacts}" if d.artifacts else ""
    if d.artifacts:
        return f"run directory {display_path(d.artifacts)}"
    return "captures not kept: --out DIR keeps them"


