"""Which job a capture or a dump set belongs to, and whether several are one job (pure).

``moe-hang analyze`` merges captures of several nodes and the dumps of several directories;
merging two *different* jobs would pair collectives that never met and blame a rank for it.
A moe-hang run directory knows its job from the allowlisted environment it recorded
(``processes.json``: TORCHELASTIC_RUN_ID, MASTER_ADDR, MASTER_PORT), its world size and the
launch command in ``meta.json`` (torchrun's ``--rdzv_id``, ``--rdzv_endpoint``,
``--master_addr``/``--master_port``: ``watch`` records no environment); a dump
set only from its layout: the file prefix (torch's default changed in 2.8 and 2.9), the format
version, the world size and the members of each process group (``pg_config``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from moe_hang.evidence.flight_recorder.postmortem import (
    LoadedSet,
    conflicting_groups,
    group_ranks,
    world_size,
)
from moe_hang.evidence.model import ProcessTable
from moe_hang.evidence.vocab import who
from moe_hang.probe.layout import RunLayout


@dataclass
class JobIdentity:
    label: str  # the path(s) it was read from
    kind: str  # capture | dumps
    run_id: str | None = None
    master: str | None = None  # MASTER_ADDR:MASTER_PORT the ranks saw
    rendezvous: str | None = None  # what the launch command asked for (endpoint or master)
    world: int | None = None
    prefix: str | None = None
    versions: frozenset[str] = frozenset()
    groups: dict[str, tuple[int, ...]] = field(default_factory=dict)
    ranks: frozenset[int] = frozenset()  # ranks it has a dump of (dump sets only)
    inconsistent: list[str] = field(default_factory=list)  # within itself


def _one(values: set[str], what: str, ident: JobIdentity) -> str | None:
    if len(values) > 1:
        ident.inconsistent.append(f"its ranks disagree on {what} ({', '.join(sorted(values))})")
    return sorted(values)[0] if values else None


def _flag(argv: list[str], *names: str) -> str | None:
    """The value of ``--name V`` or ``--name=V`` (torchrun takes both, and - or _)."""
    spellings = {n for name in names for n in (name, name.replace("_", "-"))}
    for i, a in enumerate(argv):
        key, eq, value = a.partition("=")
        if key in spellings:
            if eq:
                return value
            if i + 1 < len(argv):
                return argv[i + 1]
    return None


def _from_command(ident: JobIdentity, root: Path) -> None:
    """``meta.json``'s launch command: torchrun's rendezvous id (which becomes
    TORCHELASTIC_RUN_ID) and its endpoint or master address."""
    try:
        meta = json.loads(RunLayout(root).meta.read_text())
    except (OSError, ValueError):
        return
    cmd = meta.get("job_command") or meta.get("command") if isinstance(meta, dict) else None
    if not isinstance(cmd, list) or not all(isinstance(a, str) for a in cmd):
        return
    ident.run_id = ident.run_id or _flag(cmd, "--rdzv_id")
    addr, port = _flag(cmd, "--master_addr"), _flag(cmd, "--master_port")
    ident.rendezvous = _flag(cmd, "--rdzv_endpoint") or (
        f"{addr or '?'}:{port}" if port else None)


def of_capture(root: Path) -> JobIdentity:
    """From ``processes.json`` and ``meta.json`` (tolerant: a field it lacks is unknown, not
    a difference)."""
    ident = JobIdentity(str(root), "capture")
    try:
        table = ProcessTable.parse(json.loads(RunLayout(root).processes.read_text()))
    except (OSError, ValueError):
        _from_command(ident, root)
        return ident
    envs = [rec.env for rec in table.ranks.values() if rec.env]
    ident.run_id = _one({e["TORCHELASTIC_RUN_ID"] for e in envs if e.get("TORCHELASTIC_RUN_ID")},
                        "TORCHELASTIC_RUN_ID", ident)
    ident.master = _one({f"{e.get('MASTER_ADDR', '?')}:{e.get('MASTER_PORT', '?')}" for e in envs
                         if e.get("MASTER_ADDR") or e.get("MASTER_PORT")},
                        "MASTER_ADDR:MASTER_PORT", ident)
    ident.world = table.world_size
    _from_command(ident, root)
    return ident


def of_dumps(ls: LoadedSet) -> JobIdentity:
    ident = JobIdentity(ls.dumps.label, "dumps", prefix=ls.dumps.prefix,
                        versions=frozenset(ls.versions()), ranks=frozenset(ls.fr))
    ident.world = world_size([ls]) or None
    ident.groups = group_ranks(ls)
    for pg in conflicting_groups(ls):
        ident.inconsistent.append(f"its dumps disagree on the members of group {pg}")
    return ident


def differences(a: JobIdentity, b: JobIdentity) -> list[str]:
    """What shows ``a`` and ``b`` are different jobs (empty: nothing does)."""
    out: list[str] = []
    if a.run_id and b.run_id and a.run_id != b.run_id:
        out.append(f"TORCHELASTIC_RUN_ID {a.run_id} vs {b.run_id}")
    if a.master and b.master and a.master != b.master:
        out.append(f"MASTER_ADDR:MASTER_PORT {a.master} vs {b.master}")
    if a.rendezvous and b.rendezvous and a.rendezvous != b.rendezvous:
        out.append(f"rendezvous {a.rendezvous} vs {b.rendezvous}")
    if a.world and b.world and a.world != b.world:
        out.append(f"world size {a.world} vs {b.world}")
    if a.kind == b.kind == "dumps":
        if a.prefix != b.prefix:
            out.append(f"file prefix {a.prefix} vs {b.prefix}")
        if a.versions and b.versions and a.versions != b.versions:
            out.append(f"format version {', '.join(sorted(a.versions))} vs "
                       f"{', '.join(sorted(b.versions))}")
        both = sorted(a.ranks & b.ranks)
        if both:
            out.append(f"both hold a dump of rank {both[0]}"
                       + (f" (and {len(both) - 1} more)" if len(both) > 1 else ""))
        for pg in sorted(set(a.groups) & set(b.groups)):
            ga, gb = a.groups[pg], b.groups[pg]
            if ga is not gb and ga != gb:
                out.append(f"group {pg} is {who(ga)} vs {who(gb)}")
                break
    return out


def mismatch(idents: list[JobIdentity]) -> str | None:
    """One line naming the paths and what differs, for the first pair that is not one job
    (or the first source that contradicts itself); None when they may all be one job."""
    for ident in idents:
        if ident.inconsistent:
            return f"{ident.label} mixes jobs: {'; '.join(ident.inconsistent)}"
    for i, a in enumerate(idents):
        for b in idents[i + 1:]:
            diff = differences(a, b)
            if diff:
                return f"{a.label} and {b.label} are different jobs: {'; '.join(diff)}"
    return None
