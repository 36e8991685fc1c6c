"""The fault generator end to end (``make fuzz-smoke``; skipped without ``--fuzz``): three
generated runs (a job, its mirrored twin, the next job) through the real CLI, watch and
diagnose. What is checked is the generator, not the tool's accuracy (``make fuzz`` measures
that): every run is scored, nothing outlives it, the last line is the accuracy, every miss is
a corpus case that cases.py can read, and the JSON holds every run."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, job_env

pytestmark = [pytest.mark.e2e, pytest.mark.fuzz]

# its first jobs are small: 2 ranks, one torchrun; an op swapped under watch (and its twin),
# a skipped send under diagnose beside a busy neighbour
SEED = 1220


@pytest.mark.timeout(900)
def test_three_generated_runs_through_the_cli(tmp_path: Path) -> None:
    work = tmp_path / "fuzz"
    got = subprocess.run([sys.executable, "scripts/fuzz.py", "--seed", str(SEED), "-n", "3",
                          "--workdir", str(work)], capture_output=True, text=True,
                         timeout=840, cwd=ROOT, env=job_env(), stdin=subprocess.DEVNULL)
    lines = got.stdout.strip().splitlines()
    assert got.returncode == 0, got.stdout[-3000:] + got.stderr[-3000:]
    assert re.fullmatch(r"accuracy: [0-3]/3 runs fully right", lines[-1]), lines[-5:]
    assert sum(bool(re.match(r"\[\d/3\] seed 1220 job", x)) for x in lines) == 3
    assert "processes of any run alive at the end: 0" in got.stdout
    report = json.loads((work / "fuzz.json").read_text())
    assert report["seed"] == SEED and len(report["runs"]) == 3
    assert [r["mirrored"] for r in report["runs"]] == [False, True, False]
    modes = {r["spec"]["mode"] for r in report["runs"]}
    for r in report["runs"]:
        assert r["checks"]["run"] == "ok", r["checks"]  # scored, nothing left behind
        assert not r["survivors"] and not r["tool_leaked"]
        assert Path(r["job"]).exists() and "moe_hang" not in Path(r["job"]).read_text()
    assert modes == {"watch", "diagnose"} or len(modes) == 1
    # the busy neighbour is recorded, and died with its run (nothing of the session is left)
    assert [r["spec"]["neighbour"] for r in report["runs"]] == [False, False, True]
    sys.path.insert(0, str(ROOT / "tests" / "corpus"))
    import cases

    for miss in (work / "misses").glob("*/case.py"):
        src = miss.read_text()
        case = eval(src[src.index("Case("):].rstrip().rstrip(","), vars(cases))
        assert (miss.parent / case.job).exists()
