"""The reference's child process from the parent's side (moe_hang.runtime.reference): a bound
on the wait, its report read back, and the end of its log when there is none."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from moe_hang.errors import MoeHangError
from moe_hang.runtime.reference import await_reference, reference_report

pytestmark = pytest.mark.timeout(30)


class _Slow:
    """A child that never exits within the bound (Popen's wait, without a process)."""

    def __init__(self) -> None:
        self.waited: float | None = None

    def wait(self, timeout: float | None = None) -> int:
        self.waited = timeout
        raise subprocess.TimeoutExpired(["reference"], timeout or 0.0)


def test_a_reference_past_its_bound_is_an_error_naming_its_log(tmp_path: Path) -> None:
    slow = _Slow()
    with pytest.raises(MoeHangError, match=r"did not finish within 2 s \(see .*reference.log"):
        await_reference(slow, 2.0, tmp_path / "reference.log")  # type: ignore[arg-type]
    assert slow.waited == 2.0


def test_its_report_or_the_end_of_its_log(tmp_path: Path) -> None:
    report, log = tmp_path / "reference.json", tmp_path / "reference.log"
    log.write_text("x" * 1000 + "\nRuntimeError: the reference's own failure\n")
    with pytest.raises(MoeHangError, match="the reference's own failure"):
        reference_report(report, log)
    report.write_text(json.dumps({"ok": True, "max_rel_err": 1e-7, "compared": 12}))
    got = reference_report(report, log)
    assert got.ok and got.compared == 12 and got.max_rel_err == 1e-7
    with pytest.raises(MoeHangError, match="no output"):
        reference_report(tmp_path / "none.json", tmp_path / "none.log")
