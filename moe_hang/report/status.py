"""The live phase line a person watches while a command works (stderr, terminals only)."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from typing import Any

from rich.console import Console


@contextlib.contextmanager
def live_status(enabled: bool = True) -> Iterator[Any]:
    """A one-line live phase display on stderr; yields a ``say(text)`` callable.

    Without a terminal nobody watches it live: phases are printed as plain lines only when
    MOE_HANG_PROGRESS=1 (so pipes and CI logs see just the report and one-line errors)."""
    if not enabled or not sys.stderr.isatty():
        quiet = Console(stderr=True, highlight=False)
        show = enabled and os.environ.get("MOE_HANG_PROGRESS") == "1"

        def say_plain(text: str) -> None:
            if show:
                quiet.print(f"[dim]· {text}[/dim]")

        yield say_plain
        return
    console = Console(stderr=True, highlight=False)
    with console.status("starting", spinner="dots") as status:

        def say(text: str) -> None:
            status.update(text)

        yield say
