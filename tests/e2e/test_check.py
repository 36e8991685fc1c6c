"""`moe-hang check -- COMMAND` on a user's own job (transformers Mixtral + peft LoRA + FSDP2 per
expert, no fault planted): its plans reproduce the hang on the code as transformers 4.57
ships it, naming the rank, the expert and the token counts, and rule it out once every expert
is called every step."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
from conftest import JOBS, assert_no_survivors, free_port, job_env, run_cli

HF = all(importlib.util.find_spec(m) is not None for m in ("transformers", "peft"))
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420),
              pytest.mark.skipif(not HF, reason="transformers + peft not installed "
                                               "(make corpus-deps)")]


def _job(*extra: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
            "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
            str(JOBS / "hf_moe_train.py"), "--steps", "3", *extra]


def _check(tmp_path: Path, *extra: str) -> tuple[int, dict, str]:
    out = tmp_path / "c"
    proc = run_cli("check", "--plans", "3", "--out", str(out), "--json", "--", *_job(*extra),
                   timeout=400, env=job_env())
    assert proc.stdout.strip(), proc.stderr[-3000:]
    assert_no_survivors(str(JOBS / "hf_moe_train.py"))
    assert (out / "check.json").exists()
    return proc.returncode, json.loads(proc.stdout), proc.stderr


def test_check_reproduces_the_expert_skip_and_names_rank_expert_and_counts(tmp_path):
    code, d, _ = _check(tmp_path)
    assert d["baseline"]["verdict"] == "healthy"
    assert d["routers"]["experts"] == 4 and d["routers"]["world"] == 2
    assert d["routers"]["blocks"] == ["model.layers.0.block_sparse_moe",
                                      "model.layers.1.block_sparse_moe"]
    assert [p["plan"]["name"] for p in d["plans"]] == ["starve-e0-r1", "starve-e0-r0",
                                                       "all-to-e0-r1"]
    assert code == 3 and d["reproduced"] >= 2
    for p in d["plans"]:
        assert p["planned"], p  # the plan reached the router on its rank and step
    for name, rank in (("starve-e0-r1", 1), ("starve-e0-r0", 0)):  # mirrored: culprit swaps
        p = next(x for x in d["plans"] if x["plan"]["name"] == name)
        assert p["reproduced"], p
        assert p["culprit_ranks"] == [rank], p
        assert p["routing"].startswith(f"rank {rank} routed 0 of 32 tokens to model.layers."), p
        assert "expert 0 at step 1, by moe-hang check's plan" in p["routing"], p
        diag = json.loads((Path(p["run_dir"]) / "diagnosis.json").read_text())
        assert diag["routing"]["step"] == 1 and diag["routing"]["gaps"]


def test_check_rules_the_plans_out_once_every_expert_is_called(tmp_path):
    code, d, _ = _check(tmp_path, "--fixed")
    assert code == 0 and d["reproduced"] == 0
    assert [p["verdict"] for p in d["plans"]] == ["healthy"] * 3
    assert all(p["planned"] for p in d["plans"])  # applied, and still clean


def test_check_refuses_bad_input_before_starting_anything(tmp_path):
    for args in (["check"], ["check", "--plans", "0", "--", "true"],
                 ["check", "--", "no-such-command-xyz"],
                 ["check", "--router", "NoDots", "--", "true"]):
        proc = run_cli(*args, "--out", str(tmp_path / "x"), timeout=60) if args == ["check"] \
            else run_cli(*args, timeout=60)
        assert proc.returncode == 1, (args, proc.stdout, proc.stderr)
        assert proc.stderr.startswith("[error] ") and "Traceback" not in proc.stderr
        assert not (tmp_path / "x").exists()
