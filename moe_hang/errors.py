"""The project's one exception type.

Everything the user can cause (bad input, a missing tool, a process we may not touch) raises
:class:`MoeHangError`; only the CLI turns it into ``[error] ...`` and exit code 1.
"""


class MoeHangError(Exception):
    """A failure the user can act on, described in one line."""

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message if not self.hint else f"{self.message} ({self.hint})"
