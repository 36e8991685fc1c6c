"""The pipeline's signal handling, in this process: no children, no torch."""

from __future__ import annotations

import os
import signal

import pytest

from moe_hang.commands.session import Interrupted, interruptible
from moe_hang.runtime.procs import starting_child


def test_an_interrupt_while_a_child_starts_is_raised_once_it_is_on_record():
    """Ctrl-C between fork and bookkeeping would leave a child no teardown knows about: it is
    held until the child is recorded, then raised; a second one during the teardown is not
    raised at all (it must not cut the teardown short); and on the way out with 130/143 a
    further Ctrl-C is ignored rather than turned into a KeyboardInterrupt."""
    def deliver(sig):
        os.kill(os.getpid(), sig)
        for _ in range(1000):  # the handler runs between bytecodes: give it some
            pass

    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        recorded = []
        with pytest.raises(Interrupted), interruptible():
            with starting_child():
                deliver(signal.SIGINT)
                recorded.append("child")
            raise AssertionError("the held interrupt was not raised")
        assert recorded == ["child"]

        torn_down = []
        with pytest.raises(Interrupted), interruptible():
            try:
                deliver(signal.SIGTERM)
            finally:
                deliver(signal.SIGINT)
                torn_down.append(True)
        assert torn_down == [True]
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        for s, h in saved.items():
            signal.signal(s, h)
