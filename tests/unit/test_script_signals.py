"""A script of scripts/ ended by SIGTERM (a CI runner's timeout, ``kill``, ``timeout``) runs its
cleanup as on Ctrl-C: its runs' jobs are in process groups of their own, which the signal does
not reach, and were left running when the default action ended the script at once."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import pytest

from moe_hang.testing.script import run


@pytest.fixture
def handlers() -> Iterator[None]:
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP)}
    yield
    for s, h in before.items():
        signal.signal(s, h)


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGTERM, 143), (signal.SIGHUP, 129)])
def test_a_signal_runs_the_scripts_cleanup_and_exits_as_a_shell_reports_it(handlers, sig, code):
    cleaned: list[bool] = []

    def main() -> int:
        try:
            os.kill(os.getpid(), sig)
            time.sleep(5)  # the signal arrives here
            return 0
        finally:
            cleaned.append(True)  # where a run ends its jobs' process groups

    t0 = time.monotonic()
    with pytest.raises(SystemExit) as exc:
        run(main)
    assert exc.value.code == code and cleaned == [True]
    assert time.monotonic() - t0 < 4
