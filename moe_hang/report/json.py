"""The diagnosis for a program: ``--json`` and ``diagnosis.json`` (docs/DESIGN.md §5)."""

from __future__ import annotations

import json

from moe_hang.analysis.diagnosis import Diagnosis
from moe_hang.evidence.rankid import relabel_json


def to_json(diag: Diagnosis) -> str:
    # a rank of unknown number keeps no number in the JSON either (evidence.rankid)
    return json.dumps(relabel_json(diag.to_dict()), indent=2, default=str)
