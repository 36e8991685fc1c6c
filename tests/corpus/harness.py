"""Run one corpus case through the real CLI and score its diagnosis against the ground truth.

Shared by ``scripts/corpus.py`` (the whole corpus, a table and a JSON report) and
``tests/corpus/test_corpus.py`` (the fast subset under pytest). Stdlib and psutil only: it
never imports moe_hang, only runs its command line, so the tool can move its modules freely.

Every process a case starts carries ``MOE_HANG_CORPUS_RUN=<id>`` in its environment (it is
inherited by moe-hang, torchrun, every rank and py-spy); whatever happens, :func:`kill_run`
SIGKILLs every process that carries the id and every process group the case created, and
:func:`survivors` proves none is left.
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import importlib.util
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import psutil
from cases import (
    CASES,
    HEALTHY,
    Case,
    Env,
    Expected,
    LineExpect,
    Site,
    expected_for,
)

ROOT = Path(__file__).resolve().parents[2]
JOBS = Path(__file__).resolve().parent / "jobs"
RUN_ENV = "MOE_HANG_CORPUS_RUN"
# every run id of this process starts with it: a corpus run and a fuzz run at once (or two
# corpus runs) each check only their own processes
SESSION = uuid.uuid4().hex[:12]
MARKER_RE = re.compile(r"#\s*corpus:\s*([A-Za-z0-9_]+)\s*$")
BIN = Path(sys.executable).parent

OK = "ok"
NOT_CHECKED = "n/a"  # a field the case has nothing to say about (it may not apply)
NO_EXPECTATION = "not checked: the case states no expectation"
# what every run of a problem case is scored on: a run that leaves one unchecked is not
# "fully right" (the extras summary/basis/certainty are scored where a case states them)
REQUIRED = ("run", "verdict", "exit", "culprit", "lines", "advice")
FIELDS = ("run", "verdict", "exit", "culprit", "lines", "advice", "summary", "basis",
          "certainty")


# --- ground truth resolution -------------------------------------------------------------

def markers(job: Path) -> dict[str, int]:
    """``{name: line}`` of every ``# corpus: name`` marker in ``job`` (each name once)."""
    found: dict[str, int] = {}
    for i, line in enumerate(job.read_text().splitlines(), start=1):
        m = MARKER_RE.search(line)
        if m:
            if m.group(1) in found:
                raise ValueError(f"{job.name}: marker {m.group(1)!r} appears twice")
            found[m.group(1)] = i
    return found


def case_paths(case: Case) -> list[Path]:
    """The directories a case puts in front of its job's PYTHONPATH (``Case.pythonpath``,
    relative to the repository root): a third-party release unpacked where it cannot be
    installed beside the others (``make corpus`` puts them under ``.venv/corpus/``)."""
    return [ROOT / p for p in case.pythonpath]


def find_top(name: str, paths: list[Path] | None = None) -> Any:
    """The spec of top-level module ``name`` as the job will import it: in ``paths`` first
    (they come first on its PYTHONPATH), else in this interpreter; None when neither has it."""
    if paths:
        spec = importlib.machinery.PathFinder.find_spec(name, [str(p) for p in paths])
        if spec is not None:
            return spec
    return importlib.util.find_spec(name)


def module_file(module: str, paths: list[Path] | None = None) -> Path | None:
    """The source file of ``module`` without importing it (only its top package is located,
    in ``paths`` first)."""
    top, _, rest = module.partition(".")
    spec = find_top(top, paths)
    if spec is None or not spec.submodule_search_locations:
        return None
    base = Path(next(iter(spec.submodule_search_locations)))
    path = base.joinpath(*rest.split(".")).with_suffix(".py") if rest else base / "__init__.py"
    return path if path.exists() else None


def resolve_site(site: Site, job: Path, paths: list[Path] | None = None) -> tuple[Path, int]:
    """(file, line) that a :class:`Site` names: a marker in the job, or a needle in a module
    (looked up in ``paths`` first: the case's own package directories)."""
    if site.marker is not None:
        lines = markers(job)
        if site.marker not in lines:
            raise ValueError(f"{job.name}: no '# corpus: {site.marker}' marker")
        return job, lines[site.marker]
    assert site.module is not None and site.needle is not None
    path = module_file(site.module, paths)
    if path is None:
        raise ValueError(f"module {site.module} not found")
    for i, line in enumerate(path.read_text().splitlines(), start=1):
        if site.needle in line:
            return path, i
    raise ValueError(f"{path}: {site.needle!r} not found")


def missing_requirements(case: Case) -> list[str]:
    """The modules of ``case.requires`` the job could not import (its package directories
    first, then this interpreter's)."""
    paths = case_paths(case)
    return [m for m in case.requires if find_top(m, paths) is None]


def skip_reason(case: Case, missing: list[str]) -> str:
    where = f" in {', '.join(case.pythonpath)}" if case.pythonpath else ""
    hint = f" ({case.install_hint})" if case.install_hint else ""
    return f"skipped: {', '.join(missing)} not installed{where}{hint}"


# --- processes -----------------------------------------------------------------------------

def free_port() -> int:
    """Below the kernel's ephemeral range, in a block per pytest-xdist worker: a port bound
    to 0 and freed can be taken by one of gloo's connections before torchrun binds it (why:
    moe_hang/testing/ports.py; this harness imports nothing of the tool)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:]
    base = 20000 + 2500 * (int(worker) if worker.isdigit() else 0)  # apart from conftest's
    for port in random.sample(range(base, base + 2500), 50):
        with socket.socket() as s, contextlib.suppress(OSError):
            s.bind(("127.0.0.1", port))
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def moe_hang_argv() -> list[str]:
    """The CLI a user runs: the venv's ``moe-hang`` script, else ``python -m moe_hang.cli``;
    ``$MOE_HANG`` overrides (a path to the executable)."""
    override = os.environ.get("MOE_HANG")
    if override:
        return [override]
    exe = BIN / "moe-hang"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "moe_hang.cli"]


def _launcher() -> list[str]:
    exe = BIN / "torchrun"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "torch.distributed.run"]


def torchrun_argv(job: Path, nproc: int) -> list[str]:
    return [*_launcher(), "--nproc_per_node", str(nproc), "--master_addr", "127.0.0.1",
            "--master_port", str(free_port()), str(job)]


def torchrun_node_argv(job: Path, nproc: int, nnodes: int, endpoint: str,
                       rdzv_id: str) -> list[str]:
    """One of ``nnodes`` agents of one job (c10d rendezvous: which agent gets which ranks is
    torch's race), ``nproc // nnodes`` ranks each."""
    return [*_launcher(), "--nnodes", str(nnodes), "--nproc_per_node", str(nproc // nnodes),
            "--rdzv_backend", "c10d", "--rdzv_endpoint", endpoint, "--rdzv_id", rdzv_id,
            "--max_restarts", "0", str(job)]


def tagged(run_id: str) -> list[psutil.Process]:
    """Live processes (not zombies, not this one) whose environment carries ``run_id``."""
    found = []
    me = os.getpid()
    for p in psutil.process_iter(["pid", "status"]):
        try:
            if p.pid == me or p.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            if p.environ().get(RUN_ENV) == run_id:
                found.append(p)
        except (psutil.Error, OSError):
            continue
    return found


def any_tagged() -> list[str]:
    """Every live process carrying a run id of this session (none may be left after a
    run)."""
    found = []
    me = os.getpid()
    for p in psutil.process_iter(["pid", "status"]):
        try:
            if p.pid != me and p.info["status"] != psutil.STATUS_ZOMBIE and \
                    p.environ().get(RUN_ENV, "").startswith(SESSION + "-"):
                found.append(p)
        except (psutil.Error, OSError):
            continue
    return describe(found)


def describe(procs: list[psutil.Process]) -> list[str]:
    out = []
    for p in procs:
        try:
            out.append(f"{p.pid} {' '.join(p.cmdline())[:160]}")
        except psutil.Error:
            out.append(f"{p.pid} (gone)")
    return out


def kill_run(run_id: str, pgids: list[int], wait_s: float = 10.0) -> list[str]:
    """SIGKILL every process group in ``pgids`` and every process tagged ``run_id``, until
    none is left or ``wait_s`` ran out; returns the survivors (should be empty)."""
    deadline = time.monotonic() + wait_s
    while True:
        for pg in pgids:
            with contextlib.suppress(OSError):
                os.killpg(pg, signal.SIGKILL)
        left = tagged(run_id)
        for p in left:
            with contextlib.suppress(psutil.Error):
                p.kill()
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    time.sleep(0.1)
    return describe(tagged(run_id))


def wait_gone(run_id: str, wait_s: float) -> list[psutil.Process]:
    """Tagged processes still alive after up to ``wait_s`` (they may be ending by themselves)."""
    deadline = time.monotonic() + wait_s
    left = tagged(run_id)
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = tagged(run_id)
    return left


def wait_marks(marks: Path, name: str, count: int, proc: subprocess.Popen[bytes],
               timeout_s: float) -> str | None:
    """Until ``count`` ranks wrote ``marks/<name>.rank*``; an error string if the job exited
    first or the time ran out."""
    deadline = time.monotonic() + timeout_s
    while len(list(marks.glob(f"{name}.rank*"))) < count:
        if proc.poll() is not None:
            return f"the job exited (code {proc.returncode}) before {count} ranks marked {name!r}"
        if time.monotonic() > deadline:
            return f"{count} ranks did not mark {name!r} within {timeout_s:.0f} s"
        time.sleep(0.05)
    return None


# --- one run ---------------------------------------------------------------------------------

@dataclass
class CaseResult:
    """What one run of a case produced (before scoring)."""

    argv: list[str] = field(default_factory=list)
    exit_code: int | None = None
    diagnosis: dict[str, Any] | None = None
    error: str | None = None  # the run itself failed: timeout, no JSON, job did not get there
    timed_out: bool = False
    wall_s: float = 0.0
    tool_leaked: list[str] = field(default_factory=list)  # left behind by moe-hang itself
    survivors: list[str] = field(default_factory=list)  # left after our own kill (must be [])
    out_dir: str = ""
    stdout_path: str = ""
    stderr_path: str = ""
    job_log: str = ""
    nodes: list[CaseResult] = field(default_factory=list)  # one per watcher (nnodes > 1)


def case_env(case: Case, env: Env, marks: Path, run_id: str) -> dict[str, str]:
    full = dict(os.environ)
    full.update({"OMP_NUM_THREADS": "1", "JOB_MARKS": str(marks), RUN_ENV: run_id,
                 "PYTHONUNBUFFERED": "1"})
    pp = full.get("PYTHONPATH")
    front = [str(p) for p in case_paths(case)] + [str(ROOT)]
    full["PYTHONPATH"] = os.pathsep.join(front) + (os.pathsep + pp if pp else "")
    full.update(env)
    return full


def _read_json(stdout: Path, out_dir: Path) -> tuple[dict[str, Any] | None, str | None]:
    text = stdout.read_text(errors="replace").strip() if stdout.exists() else ""
    if text:
        try:
            return json.loads(text), None
        except json.JSONDecodeError as exc:
            err = f"stdout is not JSON ({exc}): {text[:200]!r}"
    else:
        err = "no JSON on stdout"
    saved = out_dir / "diagnosis.json"
    if saved.exists():
        try:
            return json.loads(saved.read_text()), None
        except json.JSONDecodeError:
            pass
    return None, err


def run_case(case: Case, env: Env, work: Path) -> CaseResult:
    """Run ``case`` once with role environment ``env`` in the fresh directory ``work``."""
    work.mkdir(parents=True)
    marks = work / "marks"
    marks.mkdir()
    run_id = f"{SESSION}-{uuid.uuid4().hex}"
    full_env = case_env(case, env, marks, run_id)
    job = JOBS / case.job
    out_dir = work / "out"
    res = CaseResult(out_dir=str(out_dir), stdout_path=str(work / "stdout.json"),
                  stderr_path=str(work / "stderr.log"))
    pgids: list[int] = []
    t0 = time.monotonic()
    try:
        if case.mode == "watch" and case.nnodes > 1:
            _run_watch_nodes(case, job, full_env, work, out_dir, res, pgids, run_id)
        elif case.mode == "watch":
            _run_watch(case, job, full_env, work, out_dir, res, pgids, run_id)
        elif case.mode == "analyze":
            _run_analyze(case, job, full_env, work, res, pgids, run_id)
        else:
            _run_diagnose(case, job, full_env, work, out_dir, res, pgids, run_id)
    finally:
        res.wall_s = round(time.monotonic() - t0, 2)
        res.survivors = kill_run(run_id, pgids)
    if res.diagnosis is None and res.error is None:
        res.error = "no diagnosis"
    log = Path(res.out_dir) / "job.log"
    if log.exists():
        res.job_log = str(log)
    return res


def _run_watch(case: Case, job: Path, env: dict[str, str], work: Path, out_dir: Path,
               res: CaseResult, pgids: list[int], run_id: str) -> None:
    stall = ["--stall", f"{case.stall:g}"] if case.stall is not None else []
    res.argv = [*moe_hang_argv(), "watch", "--json", "--out", str(out_dir), *stall,
                *case.watch_opts, "--",
                *torchrun_argv(job, case.nproc)]
    with open(res.stdout_path, "wb") as out, open(res.stderr_path, "wb") as err:
        proc = subprocess.Popen(res.argv, stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                                env=env, cwd=ROOT, start_new_session=True)
        pgids.append(proc.pid)
        try:
            res.exit_code = proc.wait(timeout=case.timeout_s)
        except subprocess.TimeoutExpired:
            res.timed_out = True
            res.error = f"timed out after {case.timeout_s:.0f} s"
            kill_run(run_id, pgids)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
            return
    res.tool_leaked = describe(wait_gone(run_id, 5.0))
    res.diagnosis, err_text = _read_json(Path(res.stdout_path), out_dir)
    if res.diagnosis is None:
        res.error = f"exit {res.exit_code}: {err_text}; stderr: " + \
            Path(res.stderr_path).read_text(errors="replace")[-400:]


def _run_watch_nodes(case: Case, job: Path, env: dict[str, str], work: Path, out_dir: Path,
                     res: CaseResult, pgids: list[int], run_id: str) -> None:
    """``case.nnodes`` watchers, each in front of its own torchrun agent (as srun starts
    them); the run's fields are node 0's, every node's result is in ``res.nodes``."""
    stall = ["--stall", f"{case.stall:g}"] if case.stall is not None else []
    endpoint = f"127.0.0.1:{free_port()}"
    out_dir.mkdir()
    procs: list[subprocess.Popen[bytes]] = []
    for i in range(case.nnodes):
        node = CaseResult(out_dir=str(out_dir / f"node{i}"),
                          stdout_path=str(work / f"stdout.node{i}.json"),
                          stderr_path=str(work / f"stderr.node{i}.log"))
        node.argv = [*moe_hang_argv(), "watch", "--json", "--out", node.out_dir, *stall,
                     *case.watch_opts, "--",
                     *torchrun_node_argv(job, case.nproc, case.nnodes, endpoint, run_id[:12])]
        with open(node.stdout_path, "wb") as out, open(node.stderr_path, "wb") as err:
            proc = subprocess.Popen(node.argv, stdout=out, stderr=err,
                                    stdin=subprocess.DEVNULL, env=env, cwd=ROOT,
                                    start_new_session=True)
        pgids.append(proc.pid)
        procs.append(proc)
        res.nodes.append(node)
    res.argv = res.nodes[0].argv
    deadline = time.monotonic() + case.timeout_s
    for node, proc in zip(res.nodes, procs, strict=True):
        try:
            node.exit_code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            node.timed_out = res.timed_out = True
            node.error = f"timed out after {case.timeout_s:.0f} s"
    if res.timed_out:
        kill_run(run_id, pgids)
        for proc in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
    else:
        res.tool_leaked = describe(wait_gone(run_id, 5.0))
    for node in res.nodes:
        # a watcher that timed out may have written what it concluded so far: kept to be
        # read, the run is a miss all the same
        node.diagnosis, err_text = _read_json(Path(node.stdout_path), Path(node.out_dir))
        if node.diagnosis is None and node.error is None:
            node.error = f"exit {node.exit_code}: {err_text}; stderr: " + \
                Path(node.stderr_path).read_text(errors="replace")[-400:]
        log = Path(node.out_dir) / "job.log"
        node.job_log = str(log) if log.exists() else ""
    first = res.nodes[0]
    res.exit_code, res.diagnosis = first.exit_code, first.diagnosis
    res.stdout_path, res.stderr_path = first.stdout_path, first.stderr_path
    res.out_dir = first.out_dir
    errors = [f"node {i}: {n.error}" for i, n in enumerate(res.nodes) if n.error]
    res.error = "; ".join(errors) if errors else None


def _run_diagnose(case: Case, job: Path, env: dict[str, str], work: Path, out_dir: Path,
                  res: CaseResult, pgids: list[int], run_id: str) -> None:
    job_argv = torchrun_argv(job, case.nproc)
    res.job_log = str(work / "job.log")
    marks = Path(env["JOB_MARKS"])
    deadline = time.monotonic() + case.timeout_s
    with open(res.job_log, "wb") as log:
        job_proc = subprocess.Popen(job_argv, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, env=env, cwd=JOBS,
                                    start_new_session=True)
    pgids.append(job_proc.pid)
    try:
        err = wait_marks(marks, case.wait_mark, case.marks or case.nproc, job_proc,
                         max(1.0, deadline - time.monotonic()))
        if err:
            res.error = err + ": " + Path(res.job_log).read_text(errors="replace")[-400:]
            return
        time.sleep(case.settle_s)
        res.argv = [*moe_hang_argv(), "diagnose", str(job_proc.pid), "--json", "--out",
                    str(out_dir)]
        job_tree = {job_proc.pid, *(c.pid for c in _children(job_proc.pid))}
        if not _run_tool(res, env, pgids, max(1.0, deadline - time.monotonic()),
                         f"diagnose timed out (case limit {case.timeout_s:.0f} s)"):
            return
        time.sleep(0.5)
        res.tool_leaked = describe([p for p in tagged(run_id) if p.pid not in job_tree
                                    and not _descends(p, job_tree)])
        _read_result(res, out_dir)
    finally:
        with contextlib.suppress(OSError):
            job_proc.kill()
        kill_run(run_id, pgids)
        with contextlib.suppress(subprocess.TimeoutExpired):
            job_proc.wait(timeout=10)


# analyze: how long a stuck job's recorder must stand still before its ranks dump (as
# NCCL's watchdog does at its timeout), and how long the dumps may take to appear after
FR_STALL_S = 3.0
FR_SETTLE_S = 30.0


def _dumped(dumps: Path, form: str) -> list[Path]:
    return sorted((dumps / form).glob("comm_lib_trace_rank_*"))


def _run_tool(res: CaseResult, env: dict[str, str], pgids: list[int], limit: float,
              late: str) -> bool:
    """``res.argv`` in a session of its own, its output to the result's files, bounded by
    ``limit`` seconds (False, and ``late`` as the error, where it ran past)."""
    with open(res.stdout_path, "wb") as out, open(res.stderr_path, "wb") as errf:
        tool = subprocess.Popen(res.argv, stdout=out, stderr=errf, stdin=subprocess.DEVNULL,
                                env=env, cwd=ROOT, start_new_session=True)
        pgids.append(tool.pid)
        try:
            res.exit_code = tool.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            res.timed_out, res.error = True, late
            return False
    return True


def _read_result(res: CaseResult, base: Path) -> None:
    res.diagnosis, err_text = _read_json(Path(res.stdout_path), base)
    if res.diagnosis is None:
        res.error = f"exit {res.exit_code}: {err_text}; stderr: " + \
            Path(res.stderr_path).read_text(errors="replace")[-400:]


def _run_analyze(case: Case, job: Path, env: dict[str, str], work: Path, res: CaseResult,
                 pgids: list[int], run_id: str) -> None:
    """The job under plain torchrun (no moe-hang in it); every rank whose collectives stall
    writes torch's own recorder dumps (``jobs/_frdump``: pickle with stack traces, and JSON);
    then ``moe-hang analyze --json <dumps>/<form>`` — as a user does with NCCL's dumps."""
    dumps = work / "fr"
    env = dict(env, CORPUS_FR_DUMP=str(dumps), CORPUS_FR_STALL_S=f"{FR_STALL_S:g}",
               CORPUS_FR_LIMIT_S=f"{case.timeout_s:g}")
    env["PYTHONPATH"] = str(JOBS / "_frdump") + os.pathsep + env.get("PYTHONPATH", "")
    res.job_log = str(work / "job.log")
    deadline = time.monotonic() + case.timeout_s
    with open(res.job_log, "wb") as log:
        job_proc = subprocess.Popen(torchrun_argv(job, case.nproc), stdout=log,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=env, cwd=JOBS, start_new_session=True)
    pgids.append(job_proc.pid)
    try:
        first: float | None = None
        while time.monotonic() < deadline and len(_dumped(dumps, case.form)) < case.nproc:
            if _dumped(dumps, "json") and first is None:
                first = time.monotonic()
            if first is not None and time.monotonic() - first > FR_SETTLE_S:
                break  # the others died before they could dump (gloo's abort)
            if job_proc.poll() is not None and first is None:
                break
            time.sleep(0.25)
        with contextlib.suppress(OSError):
            job_proc.kill()
        kill_run(run_id, pgids)
        res.argv = [*moe_hang_argv(), "analyze", "--json", str(dumps / case.form)]
        if not _run_tool(res, env, pgids, max(5.0, deadline - time.monotonic()),
                         f"analyze timed out (case limit {case.timeout_s:.0f} s)"):
            return
        res.tool_leaked = describe(wait_gone(run_id, 5.0))
        _read_result(res, work)
    finally:
        with contextlib.suppress(OSError):
            job_proc.kill()
        kill_run(run_id, pgids)
        with contextlib.suppress(subprocess.TimeoutExpired):
            job_proc.wait(timeout=10)


def _children(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def _descends(p: psutil.Process, tree: set[int]) -> bool:
    try:
        return any(a.pid in tree for a in p.parents())
    except psutil.Error:
        return False


# --- scoring ---------------------------------------------------------------------------------

@dataclass
class Score:
    """One run scored: per field ``ok``, ``n/a`` (not checked) or what differed."""

    case: str
    mirrored: bool
    env: dict[str, str]
    expected: dict[str, Any]
    got: dict[str, Any]
    checks: dict[str, str]
    outcome: CaseResult
    skipped: str | None = None

    @property
    def ok(self) -> bool:
        return self.skipped is None and all(v in (OK, NOT_CHECKED) for v in self.checks.values())

    @property
    def label(self) -> str:
        return self.case + (" (mirrored)" if self.mirrored else "")


def _same_file(got: str | None, want: Path) -> bool:
    if not got:
        return False
    g = Path(got)
    if g.is_absolute():
        with contextlib.suppress(OSError):
            return g.resolve() == want.resolve()
        return False
    return str(want.resolve()).endswith(os.sep + str(g)) or g.name == want.name


def _fmt_site(cs: Any) -> str:
    if not isinstance(cs, dict):
        return "-"
    return f"{Path(str(cs.get('file', '?'))).name}:{cs.get('line', '?')}"


def _by_rank(d: dict[str, Any]) -> dict[int, dict[str, Any]]:
    out = {}
    for r in d.get("ranks") or []:
        with contextlib.suppress(KeyError, TypeError, ValueError):
            out[int(r["rank"])] = r
    return out


def _divergence_site(d: dict[str, Any], rank: int) -> tuple[bool, Any]:
    """(the divergence names this rank, its call site there)."""
    fd = d.get("first_divergence")
    if not isinstance(fd, dict):
        return False, None
    per = fd.get("per_rank") or {}
    entry = per.get(str(rank))
    if not isinstance(entry, dict):
        return False, None
    return True, entry.get("callsite")


def _claimed_lines(d: dict[str, Any]) -> dict[str, Any]:
    """Every line the diagnosis gives: each rank's callsite, each side's at the divergence."""
    out = {f"rank {r}": (x or {}).get("callsite") for r, x in _by_rank(d).items()}
    per = (d.get("first_divergence") or {}).get("per_rank") or {}
    out.update({f"divergence {r}": (c or {}).get("callsite") for r, c in per.items()})
    return out


def check_lines(expects: list[LineExpect], env: Env, job: Path,
                d: dict[str, Any], paths: list[Path] | None = None) -> tuple[str, dict[str, Any]]:
    ranks = _by_rank(d)
    problems: list[str] = []
    got: dict[str, Any] = {}
    for ex in expects:
        path, line = resolve_site(ex.site, job, paths)
        for r in sorted(ex.ranks(env)):
            where = f"{path.name}:{line}"
            if ex.where in ("rank", "rank+divergence"):
                cs = (ranks.get(r) or {}).get("callsite")
                got[f"rank {r}"] = _fmt_site(cs)
                if not (isinstance(cs, dict) and cs.get("line") == line
                        and _same_file(cs.get("file"), path)):
                    problems.append(f"r{r} at {_fmt_site(cs)}≠{where}")
            if ex.where in ("divergence", "divergence?", "rank+divergence"):
                present, cs = _divergence_site(d, r)
                got[f"divergence {r}"] = _fmt_site(cs) if present else "absent"
                required = ex.where == "divergence"
                checked = (present and cs is not None) or required
                if checked and not (isinstance(cs, dict) and cs.get("line") == line
                                    and _same_file(cs.get("file"), path)):
                    problems.append(f"div r{r} at {_fmt_site(cs) if present else 'absent'}"
                                    f"≠{where}")
    return (OK if not problems else "; ".join(problems)) if expects else NOT_CHECKED, got


def score(case: Case, env: Env, mirrored: bool, outcome: CaseResult,
          require_basis: bool = False) -> Score:
    """Score one run; a multi-node run is scored on every node's diagnosis, and a field is
    right only when it is right on every node."""
    if not outcome.nodes:
        return _score_one(case, env, mirrored, outcome, require_basis)
    per = []
    for node in outcome.nodes:
        view = CaseResult(argv=node.argv, exit_code=node.exit_code, diagnosis=node.diagnosis,
                          error=node.error,
                          timed_out=node.timed_out, wall_s=outcome.wall_s,
                          tool_leaked=outcome.tool_leaked, survivors=outcome.survivors,
                          out_dir=node.out_dir, stdout_path=node.stdout_path,
                          stderr_path=node.stderr_path, job_log=node.job_log)
        per.append(_score_one(case, env, mirrored, view, require_basis))
    checks: dict[str, str] = {}
    for key in FIELDS:
        values = [s.checks[key] for s in per]
        bad = [f"node {i}: {v}" for i, v in enumerate(values) if v not in (OK, NOT_CHECKED)]
        checks[key] = "; ".join(bad) if bad else (OK if OK in values else NOT_CHECKED)
    got = dict(per[0].got)
    got["nodes"] = [s.got for s in per]
    return Score(case.name, mirrored, dict(env), per[0].expected, got, checks, outcome)


def _score_one(case: Case, env: Env, mirrored: bool, outcome: CaseResult,
               require_basis: bool = False) -> Score:
    exp = expected_for(case, env)
    job = JOBS / case.job
    expected = describe_expected(case, exp, env, job)
    checks: dict[str, str] = dict.fromkeys(FIELDS, NOT_CHECKED)
    d = outcome.diagnosis
    got: dict[str, Any] = {"exit_code": outcome.exit_code}
    leaks = outcome.tool_leaked + outcome.survivors
    checks["run"] = OK if outcome.error is None and not leaks else \
        "; ".join(filter(None, [outcome.error, f"leaked {leaks}" if leaks else ""]))
    if d is None:
        # every field this case would have checked is a miss; the others stay n/a
        expected_fields = {"verdict": True, "exit": True, "culprit": exp.culprits_check,
                           "lines": bool(exp.lines),
                           "advice": bool(exp.fix_forbid or exp.fix_require
                                          or exp.fix_none),
                           "summary": bool(exp.summary_contains),
                           "basis": bool(exp.basis) and (require_basis or case.require_basis),
                           "certainty": bool(exp.certainty)
                           and (require_basis or case.require_basis)}
        for k, wanted in expected_fields.items():
            if wanted:
                checks[k] = "no diagnosis"
        return Score(case.name, mirrored, dict(env), expected, got, checks, outcome)
    verdict = d.get("verdict")
    culprits = sorted(int(r) for r in d.get("culprit_ranks") or [])
    fix = str(d.get("fix") or "")
    summary = str(d.get("summary") or "")
    got.update(verdict=verdict, culprits=culprits, fix=fix, summary=summary,
               culprit_basis=d.get("culprit_basis"), certainty=d.get("certainty"))
    checks["verdict"] = OK if verdict in exp.verdicts else \
        f"{verdict}≠{'|'.join(sorted(exp.verdicts))}"
    # watch: a healthy job returns its own code (0 for every corpus job that finishes)
    want_exit = 0 if exp.verdicts <= HEALTHY else 3
    checks["exit"] = OK if outcome.exit_code == want_exit else \
        f"{outcome.exit_code}≠{want_exit}"
    job_rc = d.get("job_exit_code")
    got["job_exit_code"] = job_rc
    if case.mode == "watch" and exp.verdicts <= HEALTHY and job_rc not in (0, None) \
            and checks["exit"] == OK:
        checks["exit"] = f"job exit {job_rc}≠0 (the job must run to completion)"
    # a healthy verdict names nobody; a straggler names the slow rank
    want_culprits = [] if verdict == "healthy" and exp.verdicts <= HEALTHY \
        else sorted(exp.culprits)
    if exp.culprits_check:
        checks["culprit"] = OK if culprits == want_culprits else \
            f"{culprits or '[]'}≠{want_culprits or '[]'}"
    checks["lines"], got["lines"] = check_lines(list(exp.lines), env, job, d,
                                                case_paths(case))
    if exp.no_lines:
        claimed = sorted(k for k, v in _claimed_lines(d).items() if v)
        checks["lines"] = OK if not claimed else f"claims a line for {', '.join(claimed)}"
    low = fix.lower()
    bad = [s for s in exp.fix_forbid if s.lower() in low]
    missing = [s for s in exp.fix_require if s.lower() not in low]
    if exp.fix_forbid or exp.fix_require:
        parts = [f"says {s!r}" for s in bad] + [f"lacks {s!r}" for s in missing]
        checks["advice"] = OK if not parts else "; ".join(parts)
    if exp.fix_none and verdict == "healthy":
        checks["advice"] = OK if not fix.strip() else \
            f"advises {fix[:80]!r} (none is called for)"
    if exp.summary_contains:
        checks["summary"] = OK if exp.summary_contains.lower() in summary.lower() else \
            f"lacks {exp.summary_contains!r}"
    for key in REQUIRED if not exp.verdicts <= HEALTHY else ("run", "verdict", "exit"):
        if checks[key] == NOT_CHECKED:
            checks[key] = NO_EXPECTATION
    for key, want in (("basis", exp.basis), ("certainty", exp.certainty)):
        if not want:
            continue
        value = d.get("culprit_basis" if key == "basis" else "certainty")
        if value is None:
            if require_basis or case.require_basis:
                checks[key] = f"absent≠{'|'.join(sorted(want))}"
        else:
            checks[key] = OK if value in want else f"{value}≠{'|'.join(sorted(want))}"
    return Score(case.name, mirrored, dict(env), expected, got, checks, outcome)


def describe_expected(case: Case, exp: Expected, env: Env, job: Path) -> dict[str, Any]:
    lines = []
    for ex in exp.lines:
        try:
            path, line = resolve_site(ex.site, job, case_paths(case))
            site = f"{path}:{line}"
        except ValueError as exc:
            site = f"unresolved: {exc}"
        lines.append({"ranks": sorted(ex.ranks(env)), "site": site, "where": ex.where,
                      "marker": ex.site.marker, "module": ex.site.module})
    return {"verdicts": sorted(exp.verdicts), "culprits": sorted(exp.culprits),
            "culprits_checked": exp.culprits_check, "lines": lines,
            "fix_forbid": list(exp.fix_forbid), "fix_require": list(exp.fix_require),
            "fix_none": exp.fix_none, "nnodes": case.nnodes,
            "summary_contains": exp.summary_contains,
            "culprit_basis": sorted(exp.basis), "certainty": sorted(exp.certainty),
            "mode": case.mode, "nproc": case.nproc, "stall": case.stall,
            "note": case.note}


def skipped(case: Case, env: Env, mirrored: bool, why: str) -> Score:
    return Score(case.name, mirrored, dict(env), {}, {}, dict.fromkeys(FIELDS, NOT_CHECKED),
                 CaseResult(), skipped=why)


def runs_of(case: Case, mirror: bool) -> list[tuple[Env, bool]]:
    """(environment, mirrored) of each run of ``case``: itself, then its mirrored twin."""
    out: list[tuple[Env, bool]] = [(dict(case.env), False)]
    if mirror and case.mirror is not None:
        out.append(({**case.env, **case.mirror}, True))
    return out


def run_and_score(case: Case, env: Env, mirrored: bool, work: Path,
                  require_basis: bool = False) -> Score:
    missing = missing_requirements(case)
    if missing:
        return skipped(case, env, mirrored, skip_reason(case, missing))
    outcome = run_case(case, env, work)
    return score(case, env, mirrored, outcome, require_basis)


def select(names: list[str] | None, fast: bool) -> list[Case]:
    by_name = {c.name: c for c in CASES}
    if names:
        unknown = [n for n in names if n not in by_name]
        if unknown:
            raise SystemExit(f"unknown case(s): {', '.join(unknown)}; "
                             f"known: {', '.join(by_name)}")
        return [by_name[n] for n in names]
    return [c for c in CASES if c.fast] if fast else list(CASES)


def new_workdir(base: str | None = None) -> Path:
    if base:
        p = Path(base)
        p.mkdir(parents=True, exist_ok=True)
        return p
    return Path(tempfile.mkdtemp(prefix="moe-hang-corpus-"))


def outcome_from_json(run: Mapping[str, Any]) -> CaseResult:
    """The :class:`CaseResult` saved in a report's run (``score_to_json``), to score it again."""
    return CaseResult(nodes=[outcome_from_json(n) for n in run.get("nodes") or []],
                   argv=list(run.get("argv") or []), exit_code=run.get("exit_code"),
                   diagnosis=run.get("diagnosis"), error=run.get("error"),
                   timed_out=bool(run.get("timed_out")), wall_s=float(run.get("wall_s") or 0),
                   tool_leaked=list(run.get("tool_leaked") or []),
                   survivors=list(run.get("survivors") or []),
                   out_dir=str(run.get("out_dir") or ""), stdout_path=str(run.get("stdout") or ""),
                   stderr_path=str(run.get("stderr") or ""),
                   job_log=str(run.get("job_log") or ""))


def rediagnose(case: Case, outcome: CaseResult) -> CaseResult:
    """The run's saved evidence analysed again by the code here (its run directory, or the
    dumps it analysed): what a change to the analysis does to a corpus run, in a second.
    A multi-node run: every node's directory together, for each node (the captures cross
    to the analysing node as their files, read by the one loader: what its round read).
    The job is not run again; a run whose files are gone is kept as it was."""
    from moe_hang.commands.diagnose import analyze_paths
    from moe_hang.errors import MoeHangError

    if outcome.nodes:
        dirs = [Path(n.out_dir) for n in outcome.nodes if n.out_dir]
        if len(dirs) != len(outcome.nodes) or not all(d.exists() for d in dirs):
            return outcome
        try:
            d = analyze_paths(dirs, force=False).to_dict()
        except MoeHangError:
            return outcome
        return replace(outcome, nodes=[_rediagnosed(n, dict(d)) for n in outcome.nodes])
    source = outcome.argv[-1] if case.mode == "analyze" and outcome.argv else outcome.out_dir
    if not source or not Path(source).exists():
        return outcome
    try:
        d = analyze_paths([Path(source)], force=False).to_dict()
    except MoeHangError:
        return outcome
    return _rediagnosed(outcome, d)


def _rediagnosed(outcome: CaseResult, d: dict[str, Any]) -> CaseResult:
    old = outcome.diagnosis or {}
    for key in ("detected", "timings", "job_exit_code", "command"):
        if key in old:
            d[key] = old[key]
    healthy = d.get("verdict") in HEALTHY
    code = 3 if not healthy else (outcome.exit_code if outcome.exit_code != 3 else 0)
    return replace(outcome, diagnosis=d, exit_code=code)


def rescore(report: Mapping[str, Any], require_basis: bool = False,
            again: bool = False) -> list[Score]:
    """Score the runs saved in a report again against the current ground truth (no job runs):
    after a ground-truth edit, or to compare reports; ``again``: their saved evidence
    analysed again first (:func:`rediagnose`)."""
    by_name = {c.name: c for c in CASES}
    out = []
    for run in report.get("runs", []):
        case = by_name.get(run["case"])
        if case is None:
            continue
        env = dict(run.get("env") or case.env)
        if run.get("skipped"):
            out.append(skipped(case, env, bool(run.get("mirrored")), run["skipped"]))
            continue
        outcome = outcome_from_json(run)
        if again:
            outcome = rediagnose(case, outcome)
        out.append(score(case, env, bool(run.get("mirrored")), outcome, require_basis))
    return out


def _outcome_to_json(o: CaseResult) -> dict[str, Any]:
    out: dict[str, Any] = {
        "exit_code": o.exit_code, "wall_s": o.wall_s, "timed_out": o.timed_out,
        "error": o.error, "tool_leaked": o.tool_leaked, "survivors": o.survivors,
        "argv": o.argv, "out_dir": o.out_dir, "stdout": o.stdout_path,
        "stderr": o.stderr_path, "job_log": o.job_log, "diagnosis": o.diagnosis}
    if o.nodes:
        out["nodes"] = [_outcome_to_json(n) for n in o.nodes]
    return out


def score_to_json(s: Score) -> dict[str, Any]:
    return {"case": s.case, "mirrored": s.mirrored, "label": s.label, "env": s.env,
            "ok": s.ok, "skipped": s.skipped, "checks": s.checks, "expected": s.expected,
            "got": s.got, **_outcome_to_json(s.outcome)}


def env_of(mapping: Mapping[str, str]) -> Env:
    return dict(mapping)
