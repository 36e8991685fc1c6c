"""What every script of scripts/ shares: where results are written, and how a script ends."""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable
from pathlib import Path
from types import FrameType


def written(path: Path) -> Path:
    """``path``, its directory made first (a fresh clone has no ``runs/``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP, raised where the script is — as Ctrl-C is — so that its cleanup
    runs: each run's jobs are in process groups of their own, which the signal does not
    reach, and the ``finally`` that ends them would not run on the signal's default
    action."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def end_on_signals() -> None:
    """SIGTERM and SIGHUP raise :class:`Terminated` from now on."""
    def raise_terminated(signum: int, _frame: FrameType | None) -> None:
        raise Terminated(signum)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, raise_terminated)


def exit_code(exc: KeyboardInterrupt) -> int:
    """128 + the signal that ended the script, as a shell reports it (Ctrl-C: 130)."""
    return 128 + (exc.signum if isinstance(exc, Terminated) else signal.SIGINT)


def run(main: Callable[[], int | None]) -> None:
    """Run a script's ``main`` and exit with its code; an error the script did not handle is
    one line and exit 1 (never a traceback), Ctrl-C is 130, SIGTERM 143 — each after the
    script's cleanup ran."""
    end_on_signals()
    try:
        code = main()
    except KeyboardInterrupt as exc:
        print("interrupted", file=sys.stderr)
        sys.exit(exit_code(exc))
    except (OSError, ValueError, RuntimeError, TimeoutError) as exc:
        print(f"[error] {Path(sys.argv[0]).name}: {exc}", file=sys.stderr)
        sys.exit(1)
    sys.exit(code or 0)
