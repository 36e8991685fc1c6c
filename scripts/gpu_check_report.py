"""``gpu_check.py combine``: the steps' JSON files (WORKDIR/STEP.json, STEP.rc, STEP.err) as
one JSON file, and a line per step on the terminal."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

SCHEMA = "moe-hang/gpu-check/v1"


def _line(step: str, res: dict[str, Any] | None) -> str:
    if res is None:
        return "not run"
    if "stopped" in res:
        return f"{res.get('status')}: stopped by {res['stopped']} after {res.get('seconds')} s"
    if res.get("status") != "ok":
        return f"{res.get('status')}"
    if step == "env":
        return (f"{res.get('gpus')} x {', '.join(res.get('names', [])) or '-'}; torch "
                f"{res.get('torch')}, NCCL {res.get('nccl')}, ncclras {res.get('ncclras')}")
    if step == "single":
        rec = res.get("recorder", {}).get("on", {})
        ras = res.get("ras", {})
        return (f"steps/s off {res['steps_per_s']['off']} on {res['steps_per_s']['on']} "
                f"({res['timing_cost_pct']:+} % cost); timing states {rec.get('states')}; "
                f"RAS {'ok ' + str(ras.get('fmt')) if ras.get('ok') else ras.get('error')}")
    if step == "samegpu":
        return "2 ranks on one GPU: " + ("ok" if res.get("ok") else
                                          f"refused ({res.get('nccl_refused')})")
    if step == "hang":
        if "skipped" in res:
            return f"skipped: {res['skipped']}"
        dg = res.get("diagnose", {})
        return (f"cpu {res.get('cpu_percent')}; diagnose {dg.get('verdict')} "
                f"({dg.get('rule')}); py-spy {res.get('pyspy_rank0', ['-'])[:1]}")
    return "ok"


def combine(work: Path, out: Path, dry: str | None) -> int:
    steps = ("env", "single", "samegpu", "hang")
    result: dict[str, Any] = {"schema": SCHEMA, "gpu": dry is None, "dry": dry is not None,
                              "reason": dry, "host": os.uname().nodename,
                              "written": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "steps": {}}
    if dry is None:
        for s in steps:
            p = work / f"{s}.json"
            rc = work / f"{s}.rc"
            code = int(rc.read_text()) if rc.exists() else None
            why = {None: "not run", 0: "ok", 124: "timed out", 137: "killed at its timeout",
                   125: "skipped: the 5-minute budget was spent"}.get(code, f"exit {code}")
            if p.exists():  # what it measured, even if it was stopped
                result["steps"][s] = {"status": why, **json.loads(p.read_text())}
            elif code is not None:
                err = work / f"{s}.err"
                result["steps"][s] = {"status": why, "stderr_tail":
                                      err.read_text(errors="replace")[-1500:]
                                      if err.exists() else ""}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(json.dumps(result, indent=1, default=str) + "\n")
    tmp.rename(out)
    print(f"gpu_check: {'DRY — ' + dry if dry else 'GPU'}  ->  {out}")
    if dry is None:
        for s in steps:
            print(f"  {s:<8} {_line(s, result['steps'].get(s))[:150]}")
    return 0
