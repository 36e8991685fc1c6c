"""A generated job's truth in the accuracy corpus' own terms: a ``Case`` of
``tests/corpus/cases.py`` (so ``tests/corpus/harness.py`` runs and scores it, as it does the
corpus), and the same case as Python source, to be pasted into ``cases.py`` with the job file
when the tool gets it wrong. The corpus lives in the repository, not in the package: it is
imported from ``tests/corpus`` of this checkout."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

import moe_hang.testing.fuzz.truth as tr
from moe_hang.probe.env import ENV_FR_STACKS as STACKLESS_ENV
from moe_hang.testing.fuzz.draw import JobSpec
from moe_hang.testing.fuzz.truth import Truth

ROOT = Path(__file__).resolve().parents[3]
CORPUS = ROOT / "tests" / "corpus"
# the corpus' names for the verdict sets and the advice lists, for readable source
VERDICT_NAMES = {tr.HEALTHY: "HEALTHY", tr.STALLED: "STALLED", tr.DESYNC: "DESYNC",
                 tr.DESYNC_OR_HANG: "DESYNC_OR_HANG"}


def corpus_module(name: str) -> ModuleType:
    """``cases`` or ``harness`` of this checkout's tests/corpus."""
    if not (CORPUS / f"{name}.py").exists():
        raise RuntimeError(f"{CORPUS / (name + '.py')} not found: the fuzzer runs from a "
                           "checkout of the repository")
    if str(CORPUS) not in sys.path:
        sys.path.insert(0, str(CORPUS))
    return importlib.import_module(name)


def timeout_s(spec: JobSpec) -> float:
    """The hard limit of one run: generous on two shared cores (every rank imports torch)."""
    t = 120.0 + 15.0 * spec.world
    t += 60.0 if spec.build().fsdp else 0.0
    t += 60.0 if spec.launch == "two_nodes" else 0.0
    t += (spec.hang_after or 0.0) + spec.plant.seconds
    t += 60.0 if spec.neighbour else 0.0  # a core less for the ranks and the tool
    return t


def watch_opts(spec: JobSpec) -> tuple[str, ...]:
    return ("--hang-after", f"{spec.hang_after:g}") if spec.hang_after is not None else ()


def describe(spec: JobSpec) -> str:
    p = spec.plant
    fam = spec.build()
    bits = [f"{fam.doc}; {spec.world} ranks"]
    where = "before" if p.kind in _POINTS else "after" if p.kind == "fsdp_eval" else "on"
    bits.append(f"{p.kind}{' (' + p.variant + ')' if p.variant else ''} at step {p.step} of "
                f"{p.steps}, {where} `# corpus: {p.site}`")
    if spec.shape != "plain":
        bits.append(f"step layout {spec.shape}")
    if p.variant == "module":
        bits.append(f"module {p.module} skipped")
    if p.seconds:
        bits.append(f"{p.seconds:g} s")
    bits.append(f"culprits {list(spec.culprits)}, mirrored {list(spec.mirror)}")
    bits.append(f"{spec.launch}, {spec.mode}")
    if spec.neighbour:
        bits.append("beside a busy neighbour (a process burning a core)")
    if spec.stackless:
        bits.append("no call stacks in the recorder")
    return "; ".join(bits)


def role_envs(spec: JobSpec, t: Truth) -> list[dict[str, str]]:
    """Each role's environment: the truth's, and the recorder's setting where it keeps no
    call stacks."""
    extra = {STACKLESS_ENV: "0"} if spec.stackless else {}
    return [{**env, **extra} for env in t.envs()]


_POINTS = ("exception", "early_exit", "sigkill", "lock", "sleep", "busy")


def to_case(spec: JobSpec, t: Truth, job: Path) -> object:
    """The corpus ``Case`` of a generated job written to ``job``."""
    cases = corpus_module("cases")
    envs = role_envs(spec, t)
    lines = tuple(cases.LineExpect(cases.ranks(lt.var), cases.Site(marker=lt.marker), lt.where)
                  for lt in t.lines)
    return cases.Case(
        spec.name, str(job), spec.world, t.verdicts, mode=spec.mode, env=envs[0],
        mirror=envs[1] if len(envs) > 1 else None, culprits=cases.ranks(tr.CULPRITS_VAR),
        lines=lines, fix_forbid=t.fix_forbid, fix_require=t.fix_require, fix_none=t.fix_none,
        summary_contains=t.summary_contains, basis=t.basis, certainty=t.certainty,
        stall=spec.stall, watch_opts=watch_opts(spec), timeout_s=timeout_s(spec),
        nnodes=2 if spec.launch == "two_nodes" else 1, note=describe(spec))


def _set(s: frozenset[str]) -> str:
    return VERDICT_NAMES.get(s) or ("frozenset({" + ", ".join(repr(x) for x in sorted(s))
                                    + "})")


def case_source(spec: JobSpec, t: Truth, job_name: str) -> str:
    """The same case as source for tests/corpus/cases.py (``job_name`` in jobs/)."""
    envs = role_envs(spec, t)
    args = [repr(spec.name), repr(job_name), str(spec.world), _set(t.verdicts)]
    if spec.mode != "watch":
        args.append(f"mode={spec.mode!r}")
    args.append(f"env={envs[0]!r}")
    if len(envs) > 1:
        args.append(f"mirror={envs[1]!r}")
    args.append(f"culprits=ranks({tr.CULPRITS_VAR!r})")
    if t.lines:
        at = ", ".join(f"at(ranks({lt.var!r}), {lt.marker!r}, {lt.where!r})" for lt in t.lines)
        args.append(f"lines=({at},)")
    if t.fix_forbid:
        args.append(f"fix_forbid={t.fix_forbid!r}")
    if t.fix_require:
        args.append(f"fix_require={t.fix_require!r}")
    if t.fix_none:
        args.append("fix_none=True")
    if t.summary_contains:
        args.append(f"summary_contains={t.summary_contains!r}")
    if t.basis:
        args.append(f"basis={_set(t.basis)}")
    if t.certainty:
        args.append(f"certainty={_set(t.certainty)}")
    if spec.stall is not None:
        args.append(f"stall={spec.stall!r}")
    if watch_opts(spec):
        args.append(f"watch_opts={watch_opts(spec)!r}")
    if spec.launch == "two_nodes":
        args.append("nnodes=2")
    args.append(f"timeout_s={timeout_s(spec)!r}")
    args.append(f"note={describe(spec)!r}")
    return "Case(" + ",\n     ".join(args) + "),\n"
