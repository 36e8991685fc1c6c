"""Where a command will write, and whether nccl can run, checked before anything starts."""

from __future__ import annotations

import stat
import sys
from pathlib import Path

import pytest
from conftest import assert_no_survivors

from moe_hang.commands.checks import check_html, check_out
from moe_hang.config import require_gpu_per_rank
from moe_hang.errors import MoeHangError

pytestmark = pytest.mark.timeout(30)


def _refused(fn, *args, needle: str) -> None:
    with pytest.raises(MoeHangError) as exc:
        fn(*args)
    assert needle in str(exc.value) and "\n" not in str(exc.value), str(exc.value)


def test_html_must_be_a_file_in_a_writable_directory(tmp_path):
    check_html(tmp_path / "report.html")
    check_html(None)
    _refused(check_html, tmp_path, needle="is a directory")
    _refused(check_html, tmp_path / "missing" / "r.html", needle="does not exist")
    (tmp_path / "afile").write_text("x")
    _refused(check_html, tmp_path / "afile" / "r.html", needle="is not a directory")
    _refused(check_html, Path("/proc/r.html"), needle="/proc is not writable")
    assert list(tmp_path.iterdir()) == [tmp_path / "afile"]  # the probe left nothing


def test_html_inside_the_run_directory_about_to_be_created(tmp_path):
    out = tmp_path / "run"
    check_html(out / "report.html", out)
    _refused(check_html, out / "sub" / "report.html", out, needle="does not exist")
    assert not out.exists()


def test_out_is_checked_without_creating_it(tmp_path):
    check_out(tmp_path / "new" / "deeper")  # missing parents are created later, as before
    assert not (tmp_path / "new").exists()
    (tmp_path / "afile").write_text("x")
    _refused(check_out, tmp_path / "afile", needle="exists and is not a directory")
    _refused(check_out, tmp_path / "afile" / "run", needle="is not a directory")
    _refused(check_out, Path("/proc/run"), needle="/proc is not writable")


def _fake_python(tmp_path: Path, body: str) -> str:
    exe = tmp_path / "python"
    exe.write_text(f"#!{sys.executable}\nimport sys, time\n{body}\n")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return str(exe)


@pytest.mark.parametrize("body,nproc,needle", [
    ("print(''); print(0)", 2, "CPU-only build (torch.version.cuda is None)"),
    ("print('12.4'); print(1)", 2, "2 ranks need a GPU each, but CUDA sees 1"),
    ("print('12.4'); print(0)", 1, "CUDA sees 0; use --backend gloo"),
    ("sys.stderr.write('ModuleNotFoundError: torch\\n'); sys.exit(1)", 2,
     "cannot ask torch for GPUs (ModuleNotFoundError: torch)"),
])
def test_nccl_needs_a_cuda_build_and_a_gpu_per_rank(tmp_path, body, nproc, needle):
    with pytest.raises(MoeHangError) as exc:
        require_gpu_per_rank(nproc, timeout_s=60.0, python=_fake_python(tmp_path, body))
    assert needle in str(exc.value)


def test_nccl_check_passes_and_is_bounded(tmp_path):
    require_gpu_per_rank(4, timeout_s=60.0,
                         python=_fake_python(tmp_path, "print('noise'); print('12.4'); print(8)"))
    slow = _fake_python(tmp_path, "time.sleep(30)")
    with pytest.raises(MoeHangError, match="within 1 s"):
        require_gpu_per_rank(2, python=slow, timeout_s=1)
    assert_no_survivors(slow)  # killed at the timeout, not left sleeping
