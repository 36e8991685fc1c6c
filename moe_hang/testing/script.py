"""What every script of scripts/ shares: where results are written, and how a script ends."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path


def written(path: Path) -> Path:
    """``path``, its directory made first (a fresh clone has no ``runs/``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def run(main: Callable[[], int | None]) -> None:
    """Run a script's ``main`` and exit with its code; an error the script did not handle is
    one line and exit 1 (never a traceback), Ctrl-C is 130."""
    try:
        code = main()
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    except (OSError, ValueError, RuntimeError, TimeoutError) as exc:
        print(f"[error] {Path(sys.argv[0]).name}: {exc}", file=sys.stderr)
        sys.exit(1)
    sys.exit(code or 0)
