"""Shared helpers: run the real CLI, and prove no process outlives it."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from moe_hang.testing import ports

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).resolve().parent / "unit" / "fixtures"
# the processes the tests start compile this checkout once, not at every start (the Makefile
# unexports it for the whole run; run by hand, pytest itself keeps it, its children do not)
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
JOBS = Path(__file__).resolve().parent / "e2e" / "jobs"

if str(JOBS) not in sys.path:
    sys.path.append(str(JOBS))  # tests/e2e/jobs/_wait.py, shared with scripts/bench.py
from _wait import (  # noqa: E402, F401 - tests import these
    processes_mentioning,
    wait_blocked,
    wait_files,
    wait_gone,
    wait_marks,
)


def moe_hang_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "moe_hang.cli", *args]


def run_cli(*args: str, timeout: float = 120, cwd: Path | None = None,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full_env = dict(os.environ)
    full_env["PYTHONPATH"] = str(ROOT) + os.pathsep + full_env.get("PYTHONPATH", "")
    full_env.update(env or {})
    return subprocess.run(moe_hang_argv(*args), capture_output=True, text=True, timeout=timeout,
                          cwd=cwd or ROOT, env=full_env, stdin=subprocess.DEVNULL)


def processes_with_env(key: str, value: str) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["pid", "status"]):
        try:
            if p.pid == os.getpid() or p.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            if p.environ().get(key) == value:
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def assert_no_survivors(needle: str, wait: float = 5.0) -> None:
    """Every process that mentioned ``needle`` (a run directory) is gone within ``wait``."""
    deadline = time.monotonic() + wait
    left = processes_mentioning(needle)
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = processes_mentioning(needle)
    assert not left, f"processes survived: {[(p.pid, p.info['cmdline']) for p in left]}"


def job_env(**extra: str) -> dict[str, str]:
    """The environment for a CLI or job subprocess: this checkout importable, one thread."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def rank_entry(rank: int, fn, world: int, init_file: str, out_dir: str, *args) -> None:
    """One spawned rank (module level, so spawn can pickle it): join a gloo group through
    ``init_file``, run ``fn(rank, world, *args)``, then barrier, destroy the group and write
    ok<r> to ``out_dir``; on any exception write err<r> (the traceback) and exit 1."""
    import datetime
    import traceback

    import torch.distributed as dist

    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=30))
        fn(rank, world, *args)
        dist.barrier()
        dist.destroy_process_group()
        Path(out_dir, f"ok{rank}").write_text("ok")
    except BaseException:
        Path(out_dir, f"err{rank}").write_text(traceback.format_exc())
        os._exit(1)


def start_cli(*args: str, **env: str) -> subprocess.Popen[str]:
    """``moe-hang ARGS`` in the background (stdout and stderr piped, as text) with
    ``job_env(**env)``, from the checkout root."""
    return subprocess.Popen(moe_hang_argv(*args), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=job_env(**env), cwd=ROOT)


def by_rank(d: dict) -> dict[int, dict]:
    """A diagnosis's ``ranks`` keyed by rank."""
    return {r["rank"]: r for r in d["ranks"]}


def spawn_ranks(fn, args: tuple, tmp: Path, nprocs: int = 2) -> None:
    """Run ``fn(rank, nprocs, *args)`` on ``nprocs`` real processes in one gloo group (see
    :func:`rank_entry`); each writes ok<r> or err<r> (a traceback) to ``tmp``; fail the test
    with the first traceback."""
    import torch.multiprocessing as mp

    mp.start_processes(rank_entry, args=(fn, nprocs, str(tmp / "init"), str(tmp), *args),
                       nprocs=nprocs, join=True, start_method="spawn")
    errors = [p.read_text() for p in tmp.glob("err*")]
    assert not errors, errors[0]
    assert sorted(p.name for p in tmp.glob("ok*")) == [f"ok{r}" for r in range(nprocs)]


def line_of(path: Path, needle: str) -> int:
    """The line number of the first line containing ``needle`` (tests never hard-code it)."""
    for i, line in enumerate(path.read_text().splitlines(), start=1):
        if needle in line:
            return i
    raise AssertionError(f"{needle!r} not in {path}")


def fr_synth():
    """The synthetic dump generator (:mod:`moe_hang.testing.fr_synth`)."""
    from moe_hang.testing import fr_synth as mod

    return mod


def make_fr_set(out: Path, *args: str) -> dict:
    """A synthetic dump set (moe_hang.testing.fr_synth) in ``out``, and its truth.json."""
    assert fr_synth().main([str(out), "--workers", "1", *args]) == 0
    return json.loads((out / "truth.json").read_text())


def free_port() -> int:
    return ports.free_port()  # below the ephemeral range: moe_hang/testing/ports.py


def torchrun_argv(script: str, nproc: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
            "--master_addr", "127.0.0.1", "--master_port", str(free_port()), *extra,
            str(JOBS / script)]


def start_watch(tmp_path: Path, stall: str, script: str) -> tuple[subprocess.Popen[str], Path]:
    """``moe-hang watch --json`` on a 2-rank job, in the background; returns it and the marks
    directory the job writes to."""
    marks = tmp_path / "marks"
    marks.mkdir()
    proc = start_cli("watch", "--stall", stall, "--out", str(tmp_path / "w"), "--json",
                     "--", *torchrun_argv(script, 2), JOB_MARKS=str(marks))
    return proc, marks


class HungJob:
    """A small job from tests/e2e/jobs, started in its own session, waited for until it reached
    its ``mark("hang")`` point, and killed (every process of it) on exit."""

    def __init__(self, script: str, nproc: int = 2, *, launcher: str = "torchrun",
                 tmp: Path, env: dict[str, str] | None = None):
        self.marks = tmp / f"marks-{script}"
        self.marks.mkdir()
        full_env = dict(os.environ, JOB_MARKS=str(self.marks), OMP_NUM_THREADS="1")
        full_env.update(env or {})
        if launcher == "torchrun":
            argv = torchrun_argv(script, nproc)
        else:
            argv = [sys.executable, str(JOBS / "spawn_ranks.py"), str(nproc),
                    str(free_port()), str(JOBS / script)]
        self.log = open(tmp / f"{script}.log", "wb")  # noqa: SIM115
        self.popen = subprocess.Popen(argv, cwd=JOBS, env=full_env, stdout=self.log,
                                      stderr=subprocess.STDOUT, start_new_session=True)
        self.nproc = nproc

    def wait_marks(self, timeout: float = 90.0) -> None:
        try:
            wait_marks(self.marks, self.nproc, self.popen, timeout)
        except AssertionError as exc:
            raise AssertionError(f"{exc}: {Path(self.log.name).read_text()[-2000:]}") from None

    def rank_pids(self) -> dict[int, int]:
        out = {}
        for p in psutil.Process(self.popen.pid).children(recursive=True):
            try:
                env = p.environ()
                if "RANK" in env and env.get("JOB_MARKS") == str(self.marks) and \
                        p.num_threads() > 1:
                    out.setdefault(int(env["RANK"]), p.pid)
            except psutil.Error:
                continue
        return out

    def kill(self) -> None:
        for p in psutil.process_iter(["pid"]):
            try:
                if p.pid != os.getpid() and p.environ().get("JOB_MARKS") == str(self.marks):
                    p.kill()
            except psutil.Error:
                continue
        with contextlib.suppress(OSError):
            self.popen.kill()
        self.popen.wait(10)
        self.log.close()
        deadline = time.monotonic() + 5.0
        while processes_with_env("JOB_MARKS", str(self.marks)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not processes_with_env("JOB_MARKS", str(self.marks))

    def __enter__(self) -> HungJob:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()


def typer_file() -> str:
    import typer

    return str(typer.__file__)


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)  # same file system: no copy; its mode stays (site-packages: 644)
    except OSError:
        shutil.copy2(src, dst)


class AsNobody:
    """Run the tool as user ``nobody``, wherever the checkout lives: a checkout (and its .venv)
    inside a directory only root can enter is invisible to nobody, so the tool and the
    packages it imports are copied to a world-readable directory, run by an interpreter nobody
    can execute. ``sandbox`` is a directory nobody can reach (root owns it)."""

    def __init__(self, root: Path):
        self.sandbox = root / "sandbox"
        self.sandbox.mkdir(mode=0o755)
        lib = root / "lib"
        shutil.copytree(ROOT / "moe_hang", lib / "moe_hang",
                        ignore=shutil.ignore_patterns("__pycache__"))
        # the packages the CLI imports, some lazily (typer -> pydantic): all of site-packages
        # but the big ones nothing here needs (no rank is launched as nobody)
        site = Path(typer_file()).parent.parent
        heavy = ("torch*", "nvidia*", "triton*", "sympy*", "networkx*", "numpy*", "mypy*",
                 "*mypyc*", "transformers*", "tokenizers*", "hf_xet*", "pip", "pip-*",
                 "__editable__*", "*.pth", "__pycache__")
        shutil.copytree(site, lib, ignore=shutil.ignore_patterns(*heavy), dirs_exist_ok=True,
                        copy_function=_link_or_copy)
        for p in [root, *(d for d in root.rglob("*") if d.is_dir())]:
            p.chmod(0o755)
        self.env = {"PYTHONPATH": str(lib), "HOME": "/tmp", "PATH": os.environ["PATH"]}
        self.python = self._interpreter()

    @staticmethod
    def _prefix() -> list[str]:
        return ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"]

    def _interpreter(self) -> str:
        want = f"{sys.version_info[0]}.{sys.version_info[1]}"
        for cand in (os.path.realpath(sys.executable), f"/usr/bin/python{want}"):
            try:
                got = subprocess.run([*self._prefix(), cand, "-c",
                                      "import sys; print('%d.%d' % sys.version_info[:2])"],
                                     capture_output=True, text=True, timeout=30, env=self.env)
            except (OSError, subprocess.TimeoutExpired):
                continue
            if got.returncode == 0 and got.stdout.strip() == want:
                return cand
        pytest.skip(f"no Python {want} that user nobody may execute (the interpreter lives "
                    "in a directory only root can enter)")

    def run(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*self._prefix(), self.python, "-m", "moe_hang.cli", *args],
                              capture_output=True, text=True, timeout=timeout, env=self.env,
                              cwd="/tmp", stdin=subprocess.DEVNULL)


@pytest.fixture(scope="session")
def as_nobody() -> Iterator[AsNobody]:
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to run the tool as another user")
    root = Path(tempfile.mkdtemp(prefix="moe-hang-nobody-", dir="/tmp"))
    try:
        yield AsNobody(root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def load_json(path: Path) -> dict:
    return json.loads(path.read_text())


@pytest.fixture
def short_tmp():
    """A directory with a short path (/tmp/mh-XXXX), for tests that read a first screen at 80
    columns: a run directory's path is one unbreakable word there, and pytest's own temporary
    paths (longer under pytest-xdist's workers) would wrap it."""
    import shutil
    import tempfile

    d = Path(tempfile.mkdtemp(prefix="mh-", dir="/tmp"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def fixtures() -> Path:
    return FIXTURES


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--matrix", action="store_true", default=False,
                     help="also run the full scenario matrix (make test-matrix)")
    parser.addoption("--fuzz", action="store_true", default=False,
                     help="also run the fault generator's smoke test (make fuzz-smoke)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    opt_in = {"matrix": "full matrix: run `make test-matrix`",
              "fuzz": "generated jobs: run `make fuzz-smoke`"}
    for marker, reason in opt_in.items():
        if config.getoption(f"--{marker}"):
            continue
        skip = pytest.mark.skip(reason=reason)
        for item in items:
            if item.get_closest_marker(marker) is not None:
                item.add_marker(skip)


def relocated(src: Path, dst: Path, old: str, new: str) -> Path:
    """A recorded capture whose source paths (``old``: the checkout it was recorded in) point
    into ``new`` instead, wherever this checkout lies (the analysis reads the job's source to
    order its lines)."""
    import pickle
    import shutil

    def swap(x):
        if isinstance(x, str):
            return x.replace(old, new)
        if isinstance(x, list):
            return [swap(v) for v in x]
        if isinstance(x, dict):
            return {swap(k): swap(v) for k, v in x.items()}
        return x

    shutil.copytree(src, dst)
    for p in dst.rglob("*"):
        if p.suffix == ".pkl":
            p.write_bytes(pickle.dumps(swap(pickle.loads(p.read_bytes()))))
        elif p.is_file():
            p.write_text(p.read_text().replace(old, new))
    return dst


def captured(ev):
    """``ev`` as a capture made here stores it: with the facts of the job's source read now
    (``moe_hang.capture.source``), as watch and diagnose do when they capture."""
    from moe_hang.capture.source import record

    record(ev)
    return ev
