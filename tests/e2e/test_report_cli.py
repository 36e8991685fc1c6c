"""The report through the real CLI: one screen at 80 columns after a real repro, the HTML page,
verify's regression-check wording, refusals before anything runs, and watch passing the job's
bytes through (``\\r`` progress bars, a terminal's status line, Ctrl-C)."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pty
import re
import select
import signal
import struct
import subprocess
import sys
import termios
import time
from html.parser import HTMLParser
from pathlib import Path

import pytest
from conftest import (
    JOBS,
    ROOT,
    assert_no_survivors,
    free_port,
    job_env,
    moe_hang_argv,
    run_cli,
    start_cli,
    torchrun_argv,
    wait_marks,
)

from moe_hang.report.wrap import screen_lines

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

COLS = {"COLUMNS": "80"}  # a pipe: the report is laid out for 80 columns


def _first_screen_ok(out: str) -> None:
    lines = out.splitlines()
    assert screen_lines(lines, 80) <= 15, out
    assert max(len(x) for x in lines) <= 80, out


class _Page(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str]]] = []
        self.data: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, {k: v or "" for k, v in attrs}))

    def handle_data(self, data):
        self.data.append(data)

    def all(self, tag: str, cls: str = "") -> list[dict[str, str]]:
        return [a for t, a in self.tags if t == tag and cls in a.get("class", "")]


def test_repro_answer_fits_one_screen_and_the_rest_is_in_the_files(short_tmp):
    run = short_tmp / "run"
    page = run / "report.html"
    proc = run_cli("repro", "--out", str(run), "--html", str(page), env=COLS)
    assert proc.returncode == 3, proc.stderr
    out = proc.stdout
    _first_screen_ok(out)
    lines = out.splitlines()
    assert lines[0] == "moe-hang repro: DESYNC"
    # the call site of both ranks (grouped when only the sizes differ), the sizes in the text
    assert "all_gather default_pg#1" in out and "at moe_hang/scenarios/ep.py:" in out
    assert "68×64" in out and "401×64" in out
    assert "fix: Replace DTensor.from_local" in out and "VarlenDispatch" in out
    assert "next: moe-hang verify --fixed\n" in out
    assert f"run directory {run}" in out
    for detail in ("stacks", "collectives of default_pg", "first divergence"):
        assert detail not in out, detail
    assert "evidence" not in [line.strip() for line in lines]  # the detail's heading
    log = (run / "console.log").read_text()
    for detail in ("stacks", "evidence", "collectives of default_pg", "first divergence"):
        assert detail in log, detail
    # no word broken at 80 columns: every name (a path, a function, file:line) is a word of
    # console.log (120 columns, detail included)
    names = {w for w in out.split() if any(c in w for c in "/_:.")}
    assert not names - set(log.split()) - {"console.log", "details:"}
    # the page: verdict, ranks, the marked column, stacks folded, evidence, relative links
    p = _Page()
    p.feed(page.read_text())
    text = "".join(p.data)
    assert "moe-hang repro: DESYNC" in text and "Ranks posted different sizes" in text
    assert len(p.all("table", "ranks")) == 1 and len(p.all("tr", "culprit")) == 2
    assert len(p.all("th", "diverge")) == 1 and len(p.all("td", "diverge")) == 2
    assert len(p.all("details", "stack")) == 2 and p.all("ul", "evidence")
    hrefs = {a["href"] for a in p.all("a")}
    assert {"diagnosis.json", "console.log", "job.log", "ranks/rank0.tokens.jsonl"} <= hrefs
    assert not p.all("script") and not [h for h in hrefs if "://" in h]
    assert_no_survivors(str(run))


def test_verify_without_fixed_is_a_passed_regression_check(tmp_path):
    run = tmp_path / "run"
    proc = run_cli("verify", "--out", str(run), env=COLS)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    _first_screen_ok(out)
    assert out.splitlines()[0] == ("moe-hang verify: regression check passed: the broken "
                                   "variant still reproduces")
    assert "DESYNC" not in out and "Ranks posted different sizes" in out
    assert "all_gather default_pg#1 [68×64]" in out and "next:" not in out
    assert_no_survivors(str(run))


# ----------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("args,needle", [
    (["repro", "--html", "{tmp}/missing/r.html"], "does not exist"),
    (["repro", "--html", "{tmp}"], "is a directory"),
    (["repro", "--html", "/proc/r.html"], "/proc is not writable"),
    (["verify", "--fixed", "--out", "{tmp}/afile/run"], "is not a directory"),
    (["watch", "--html", "{tmp}/missing/r.html", "--", sys.executable, "{tmp}/job.py"],
     "does not exist"),
    (["watch", "--out", "/proc/run", "--", sys.executable, "{tmp}/job.py"],
     "/proc is not writable"),
    (["diagnose", "1", "--html", "{tmp}"], "is a directory"),
    (["analyze", "{tmp}", "--html", "{tmp}/missing/r.html"], "does not exist"),
])
@pytest.mark.timeout(60)
def test_bad_output_paths_are_refused_before_anything_runs(tmp_path, args, needle):
    marker = tmp_path / "launched"
    (tmp_path / "job.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    (tmp_path / "afile").write_text("x")
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    proc = run_cli(*[a.replace("{tmp}", str(tmp_path)) for a in args], cwd=cwd, timeout=50)
    assert proc.returncode == 1, (proc.returncode, proc.stdout, proc.stderr)
    err = proc.stderr.strip()
    assert err.startswith("[error] ") and "\n" not in err and needle in err, err
    assert not proc.stdout and not marker.exists() and not list(cwd.iterdir())
    assert_no_survivors(str(tmp_path))


@pytest.mark.timeout(90)
def test_nccl_without_a_gpu_per_rank_is_refused_up_front(tmp_path):
    import torch

    if torch.version.cuda is not None and torch.cuda.device_count() >= 2:
        pytest.skip("this machine has a GPU per rank")
    out = tmp_path / "run"
    proc = run_cli("repro", "--backend", "nccl", "--out", str(out), timeout=80)
    assert proc.returncode == 1, proc.stderr
    err = proc.stderr.strip()
    assert err.startswith("[error] --backend nccl: ") and "\n" not in err, err
    assert not out.exists() and not proc.stdout
    assert_no_survivors(str(out))


# ----------------------------------------------------------------------------- watch

PROGRESS = [f"\rtraining {i}/5".encode() for i in range(1, 6)]
_JOB = """import os, sys, time
import torch.distributed as dist
dist.init_process_group("gloo")
if dist.get_rank() == 0:
    for burst in range({bursts}):
        for i in range(1, 6):  # a tqdm-like bar: carriage returns, no newline until done
            sys.stdout.write(f"\\rtraining {{i}}/5"); sys.stdout.flush(); time.sleep(0.1)
        sys.stdout.write(" done\\n"); sys.stdout.flush()
        time.sleep({pause})
dist.barrier()
dist.destroy_process_group()
"""
EXPECTED = b"".join(PROGRESS) + b" done\n"


def _progress_job(tmp_path: Path, bursts: int = 1, pause: float = 0.0) -> Path:
    script = tmp_path / "progress.py"
    script.write_text(_JOB.format(bursts=bursts, pause=pause))
    return script


def _watch_argv(out: Path, script: Path, *opts: str) -> list[str]:
    return moe_hang_argv("watch", "--out", str(out), *opts, "--", sys.executable, "-m",
                         "torch.distributed.run", "--nproc_per_node", "2", "--master_addr",
                         "127.0.0.1", "--master_port", str(free_port()), str(script))


@pytest.mark.timeout(200)
def test_watch_passes_a_progress_bar_through_byte_for_byte(tmp_path, short_tmp):
    script = _progress_job(tmp_path)
    for as_json in (False, True):
        out = short_tmp / f"w-{as_json}"
        proc = subprocess.run(_watch_argv(out, script, *(["--json"] if as_json else [])),
                              capture_output=True, timeout=150, env=job_env(**COLS), cwd=ROOT,
                              stdin=subprocess.DEVNULL)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert EXPECTED in out.joinpath("job.log").read_bytes()
        if as_json:  # the job's bytes on stderr, the JSON alone on stdout
            assert EXPECTED in proc.stderr
            assert json.loads(proc.stdout)["verdict"] == "healthy"
        else:
            assert EXPECTED in proc.stdout
            report = proc.stdout.split(EXPECTED, 1)[1].decode()
            assert "moe-hang watch: HEALTHY" in report
            _first_screen_ok(report[report.index("moe-hang watch"):])
        assert b"\x1b[" not in proc.stdout + proc.stderr  # no status line without a terminal
    assert_no_survivors(str(script))


def test_ctrl_c_under_watch_is_one_line_of_ours_and_no_torchrun_traceback(tmp_path):
    marks = tmp_path / "marks"
    marks.mkdir()
    out = tmp_path / "w"
    proc = start_cli("watch", "--stall", "60", "--out", str(out), "--",
                     *torchrun_argv("straggler.py", 2), JOB_MARKS=str(marks))
    try:
        wait_marks(marks, 2, proc, 90)
        time.sleep(0.5)  # the ranks are in the all-reduce / computing
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130
    assert stderr.strip() == ("[error] interrupted (SIGINT); the job and every process it "
                              "started were ended")
    log = (out / "job.log").read_text()
    assert "SignalException" in log  # torchrun did print its traceback ...
    assert "Traceback" not in stdout and "SignalException" not in stdout  # ... not to us
    assert_no_survivors(str(JOBS / "straggler.py"))


_STATUS = re.compile(r"\r\x1b\[K(?:\x1b\[36m.\x1b\[0m [^\r\n\x1b]*)?")


def _on_a_pty(argv: list[str], env: dict[str, str], timeout: float) -> tuple[int, str]:
    """Run ``argv`` with stdin, stdout and stderr on one 80×24 terminal; what it showed."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, env=env, cwd=ROOT,
                            start_new_session=True)
    os.close(slave)
    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.2)
            if ready:
                try:
                    data = os.read(master, 65536)
                except OSError:  # EIO: every writer is gone
                    break
                if not data:
                    break
                chunks.append(data)
            elif proc.poll() is not None:
                break
        rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        os.close(master)
    return rc, b"".join(chunks).decode(errors="replace")


@pytest.mark.timeout(200)
def test_on_a_terminal_the_status_line_never_lands_on_a_job_line(tmp_path):
    script = _progress_job(tmp_path, bursts=2, pause=1.5)
    env = job_env(NO_COLOR="1", TERM="xterm")
    env.pop("COLUMNS", None)
    rc, shown = _on_a_pty(_watch_argv(tmp_path / "w", script), env, timeout=150)
    assert rc == 0, shown[-2000:]
    live, _, report = shown.partition("moe-hang watch: ")
    pieces = _STATUS.split(live)
    statuses = _STATUS.findall(live)
    draws = [s for s in statuses if len(s) > len("\r\x1b[K")]
    assert draws, "no status line on a terminal"
    last = "\n"
    job_text = ""
    for i, piece in enumerate(pieces):
        job_text += piece
        last = piece[-1] if piece else last
        if i < len(statuses) and len(statuses[i]) > len("\r\x1b[K"):
            assert last == "\n", f"status drawn after the job's {last!r}: {live!r}"
    job_text = job_text.replace("\r\n", "\n")
    assert job_text.count(EXPECTED.decode()) == 2, repr(job_text)
    report = re.sub(r"\x1b\[[0-9;]*m", "", report.replace("\r\n", "\n"))  # bold, dim
    _first_screen_ok("moe-hang watch: " + report)
    assert_no_survivors(str(script))


@pytest.mark.parametrize("as_json", [False, True], ids=["screen", "json"])
def test_a_reader_that_closed_the_pipe_keeps_the_verdicts_exit_code(as_json):
    """`moe-hang analyze ... | head -1`: the reader is gone before the answer is written.
    The verdict's exit code stands (3 here, as without the pipe), with no traceback — rich's
    own handling exited 1, which a script would read as a tool error."""
    dumps = ROOT / "tests" / "unit" / "fixtures" / "fr_started" / "json"
    argv = [*moe_hang_argv(), "analyze", str(dumps), *(["--json"] if as_json else [])]
    assert run_cli("analyze", str(dumps)).returncode == 3
    r, w = os.pipe()
    proc = subprocess.Popen(argv, stdout=w, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                            env=job_env(), cwd=ROOT)
    os.close(w)
    os.close(r)  # before the tool has written a line
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 3, err.decode(errors="replace")
    assert b"Traceback" not in err and b"BrokenPipe" not in err
