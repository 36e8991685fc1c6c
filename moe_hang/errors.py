"""The project's one exception type, the interrupt that unwinds a command, and the exit codes.

Everything the user can cause (bad input, a missing tool, a process we may not touch) raises
:class:`MoeHangError`; only the CLI turns it into ``[error] ...`` and exit code 1.
"""

from __future__ import annotations

# Exit codes (docs/DESIGN.md §4).
EXIT_OK = 0
EXIT_TOOL_ERROR = 1
EXIT_USAGE = 2
EXIT_PROBLEM = 3
EXIT_VERIFY_FAILED = 4


class MoeHangError(Exception):
    """A failure the user can act on, described in one line."""

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message if not self.hint else f"{self.message} ({self.hint})"


class Interrupted(Exception):
    """Ctrl-C or SIGTERM: unwind through every ``finally`` so children are ended. Its text is
    the signal's name (``SIGINT``, ``SIGTERM``)."""

    @property
    def exit_code(self) -> int:
        """128 + the signal, as a shell reports it (130 for Ctrl-C, 143 for SIGTERM)."""
        return 143 if "SIGTERM" in str(self) else 130
