"""What a job does after its capture is not evidence of its hang: the tool ends the job once
the verdict is made, and a rank's collective then raises ("Connection reset by peer"),
recorded in its run directory after the verdict (fresh fuzz seed 28276042, job 94
mirrored: an FSDP2 job with a metrics thread on 6 ranks, recorded under ``moe-hang
watch``; ``captured_at`` as watch now writes it, the moment of its stacks)."""

from __future__ import annotations

import json
import shutil

from moe_hang.analysis.rules import diagnose
from moe_hang.evidence.load import load_capture

NAME = "teardown_error_after_capture"


def _lines(d: dict) -> dict[int, int]:
    return {r["rank"]: r["callsite"]["line"] for r in d["ranks"] if r.get("callsite")}


def test_an_exception_raised_after_the_capture_is_not_the_ranks_state(fixtures, tmp_path):
    """Rank 5 was in its metrics thread's all-reduce (line 73) when captured; its main
    thread's barrier raised as the job was ended. ``analyze`` of the directory says what
    the verdict said (was: line 99, the barrier that raised, and a different rank table)."""
    ev = load_capture(fixtures / NAME)
    assert ev.ranks[5].error is None
    assert any("after the capture" in n for n in ev.ranks[5].notes)
    d = diagnose(ev).to_dict()
    assert (d["verdict"], d["culprit_ranks"]) == ("desync", [1]), d["summary"]
    assert _lines(d) == {0: 73, 1: 99, 2: 73, 3: 73, 4: 73, 5: 73}
    # a capture from before (no moment recorded): the exception is taken as it always was
    old = tmp_path / "old"
    shutil.copytree(fixtures / NAME, old)
    table = json.loads((old / "processes.json").read_text())
    del table["captured_at"]
    (old / "processes.json").write_text(json.dumps(table))
    ev = load_capture(old)
    assert ev.ranks[5].error is not None
    assert _lines(diagnose(ev).to_dict())[5] == 99
