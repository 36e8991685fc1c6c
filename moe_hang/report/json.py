"""The diagnosis for a program: ``--json`` and ``diagnosis.json`` (docs/DESIGN.md §5)."""

from __future__ import annotations

import json

from moe_hang.analysis.diagnosis import Diagnosis


def to_json(diag: Diagnosis) -> str:
    return json.dumps(diag.to_dict(), indent=2, default=str)
