"""Either of NCCL's RAS report formats, from text or a file -> :class:`RasReport` — pure."""

from __future__ import annotations

from pathlib import Path

from moe_hang.evidence.ras.jsonreport import parse_json_report
from moe_hang.evidence.ras.records import RasReport, RasReportError
from moe_hang.evidence.ras.textreport import parse_text_report

MAX_REPORT_BYTES = 64 * 1024 * 1024  # a report of 100k ranks is ~60 MB of JSON


def parse_report(text: str) -> RasReport:
    """JSON when the report begins with ``{`` (after whitespace), else the text report."""
    body = text.lstrip()
    if not body:
        raise RasReportError("the report is empty")
    return parse_json_report(body) if body.startswith("{") else parse_text_report(body)


def load_report(path: Path) -> RasReport:
    """A saved report (``ncclras > FILE``, or a capture); the error names the file."""
    try:
        if path.stat().st_size > MAX_REPORT_BYTES:
            raise RasReportError(f"{path}: larger than {MAX_REPORT_BYTES >> 20} MiB")
        raw = path.read_bytes()
    except OSError as exc:
        raise RasReportError(f"{path}: {exc.strerror or exc}") from None
    try:
        return parse_report(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise RasReportError(f"{path}: not UTF-8 text") from None
    except RasReportError as exc:
        raise RasReportError(f"{path}: {exc}") from None
