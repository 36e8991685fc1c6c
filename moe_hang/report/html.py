"""The report as files: the console's text (``console.log``) and a self-contained HTML page."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from moe_hang.probe.probe import write_atomic


def save_console(console: Console, path: Path | None, html: Path | None = None) -> None:
    if html is not None:
        write_atomic(html, console.export_html(clear=False).encode())
    if path is not None:
        write_atomic(path, console.export_text(clear=False).encode())
