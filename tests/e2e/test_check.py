"""`moe-hang check -- COMMAND` on users' own jobs with no fault planted: its plans reproduce the
hang on the code as written, naming the rank, the expert (or the EP gather) and the token
counts, and rule it out once fixed. A plain-torch MoE with FSDP2 per expert (always run), and
where installed (make corpus-deps) transformers' Mixtral + peft + FSDP2 and NeMo Automodel's
GroupedExpertsLoRA before and after PR #3631."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest
from conftest import (
    JOBS,
    ROOT,
    assert_no_survivors,
    free_port,
    job_env,
    run_cli,
    start_cli,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420)]
HF = all(importlib.util.find_spec(m) is not None for m in ("transformers", "peft"))
AUTOMODEL = ROOT / ".venv" / "corpus"
TRANSFORMERS5 = AUTOMODEL / "transformers-5.25.0"


def _job(script: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
            "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
            str(JOBS / script), "--steps", "3", *extra]


def _check(tmp_path: Path, script: str, *extra: str, plans: int = 3,
           **env: str) -> tuple[int, dict]:
    out = tmp_path / "c"
    tmp_path.mkdir(parents=True, exist_ok=True)  # --html's directory must exist
    proc = run_cli("check", "--plans", str(plans), "--out", str(out), "--json", "--html",
                   str(tmp_path / "check.html"), "--", *_job(script, *extra), timeout=400,
                   env=job_env(**env))
    assert proc.stdout.strip(), proc.stderr[-3000:]
    assert_no_survivors(str(JOBS / script))
    assert (out / "check.json").exists() and oct(out.stat().st_mode)[-3:] == "700"
    return proc.returncode, json.loads(proc.stdout)


def _by_name(d: dict) -> dict[str, dict]:
    return {p["plan"]["name"]: p for p in d["plans"]}


def _starve_mirrored(d: dict, block: str, tokens: int) -> None:
    """Expert 0 starved on rank 1, then on rank 0: the culprit moves with the plan, and the
    verdict names the block, the expert, the step and both ranks' counts."""
    for name, rank in (("starve-e0-r1", 1), ("starve-e0-r0", 0)):
        p = _by_name(d)[name]
        assert p["reproduced"] and p["culprit_ranks"] == [rank], p
        assert p["routing"].startswith(f"rank {rank} routed 0 of {tokens} tokens to {block}"), p
        assert "expert 0 at step 1, by moe-hang check's plan" in p["routing"], p
        diag = json.loads((Path(p["run_dir"]) / "diagnosis.json").read_text())
        assert diag["routing"]["step"] == 1 and diag["routing"]["gaps"]


def test_plain_torch_moe_reproduced_and_ruled_out_once_fixed(tmp_path):
    code, d = _check(tmp_path / "a", "moe_fsdp_train.py", plans=2)  # CI time: two plans
    assert d["baseline"]["verdict"] == "healthy" and d["routers"]["blocks"] == ["0", "1"]
    assert [p["plan"]["name"] for p in d["plans"]] == ["starve-e0-r1", "starve-e0-r0"]
    assert all(p["planned"] for p in d["plans"])  # each reached its rank's routers
    assert code == 3
    _starve_mirrored(d, "block 0", 32)
    page = (tmp_path / "a" / "check.html").read_text()  # --html: each reproduction linked
    assert "REPRODUCED by" in page and "c/01-starve-e0-r1/report.html" in page
    assert (tmp_path / "a" / "c" / "01-starve-e0-r1" / "report.html").exists()
    code, d = _check(tmp_path / "b", "moe_fsdp_train.py", "--fixed", plans=1)
    assert code == 0 and d["reproduced"] == 0
    assert [p["verdict"] for p in d["plans"]] == ["healthy"]
    assert all(p["planned"] for p in d["plans"])  # applied, and still clean


def test_a_compiled_model_is_said_so_and_checked_with_compile_off(tmp_path):
    """torch.compile traces the routers into its graphs, where nothing counts or re-routes
    them: said as that, not "no router" with the advice to name one; with compile off (the
    variable the screen names) the same job's routers are found and a plan reproduces."""
    code, d = _check(tmp_path / "a", "moe_fsdp_train.py", "--compile", plans=1)
    assert code == 0 and d["compiled"] is True and d["routers"] is None, d
    assert d["baseline"]["verdict"] == "healthy" and d["plans"] == []
    page = (tmp_path / "a" / "check.html").read_text()
    assert "no MoE router seen outside torch.compile" in page
    code, d = _check(tmp_path / "b", "moe_fsdp_train.py", "--compile", plans=1,
                     TORCH_COMPILE_DISABLE="1")
    assert d["compiled"] is False and d["routers"]["blocks"] == ["0", "1"], d
    assert code == 3 and d["plans"][0]["culprit_ranks"] == [1]


@pytest.mark.skipif(not HF, reason="transformers + peft not installed (make corpus-deps)")
def test_transformers_mixtral_peft_fsdp2(tmp_path):
    code, d = _check(tmp_path / "a", "hf_moe_train.py")
    assert code == 3 and d["baseline"]["verdict"] == "healthy"
    assert d["routers"]["blocks"] == ["model.layers.0.block_sparse_moe",
                                      "model.layers.1.block_sparse_moe"]
    _starve_mirrored(d, "model.layers.", 32)
    code, d = _check(tmp_path / "b", "hf_moe_train.py", "--fixed")
    assert code == 0 and [p["verdict"] for p in d["plans"]] == ["healthy"] * 3


@pytest.mark.skipif(not all((AUTOMODEL / f"nemo-automodel-{v}").is_dir()
                            for v in ("0.5.0", "0.7.0")),
                    reason="nemo-automodel 0.5.0 and 0.7.0 not installed (make corpus-deps)")
def test_nemo_automodel_grouped_experts_lora_before_and_after_pr_3631(tmp_path):
    def check(v: str, where: Path) -> tuple[int, dict]:
        path = os.pathsep.join([str(AUTOMODEL / f"nemo-automodel-{v}"),
                                os.environ.get("PYTHONPATH", "")])
        return _check(where, "automodel_train.py", plans=4, PYTHONPATH=path)

    code, d = check("0.5.0", tmp_path / "a")
    assert code == 3 and d["baseline"]["verdict"] == "healthy"
    ragged = _by_name(d)["ragged-r1"]
    assert ragged["reproduced"] and ragged["verdict"] == "desync", ragged
    assert "lora_experts.py:184" in ragged["summary"]  # the EP gather of 0.5.0
    assert ragged["routing"] == ("rank 1 sent 10 tokens into MoEBlock at step 1, by "
                                 "moe-hang check's plan (rank 0: 64)")
    assert _by_name(d)["no-token-r1"]["reproduced"]
    code, d = check("0.7.0", tmp_path / "b")
    assert code == 0 and [p["verdict"] for p in d["plans"]] == ["healthy"] * 4
    assert all(p["planned"] for p in d["plans"])


@pytest.mark.skipif(not (HF and TRANSFORMERS5.is_dir()),
                    reason="transformers 5 not installed (make corpus-deps)")
def test_transformers_5_fused_experts_found_and_every_plan_clean(tmp_path):
    """transformers 5's Mixtral: the experts are one module, called whatever the routing."""
    code, d = _check(tmp_path, "hf5_moe_train.py", plans=4, PYTHONPATH=str(TRANSFORMERS5))
    blocks = ["model.layers.0.mlp", "model.layers.1.mlp"]
    assert d["routers"]["blocks"] == blocks and d["routers"]["fused"] == blocks
    assert d["routers"]["experts"] == 4
    assert code == 0 and [p["verdict"] for p in d["plans"]] == ["healthy"] * 4
    assert all(p["planned"] for p in d["plans"])  # the index router was rerouted


def test_check_refuses_bad_input_before_starting_anything(tmp_path):
    for args in (["check"], ["check", "--plans", "0", "--", "true"],
                 ["check", "--", "no-such-command-xyz"],
                 ["check", "--router", "NoDots", "--", "true"],
                 ["check", "--timeout", "0", "--", "true"]):
        proc = run_cli(*args, timeout=60, cwd=tmp_path)
        assert proc.returncode == 1, (args, proc.stdout, proc.stderr)
        assert proc.stderr.startswith("[error] ") and "Traceback" not in proc.stderr
        assert not (tmp_path / "runs").exists(), args  # refused before a run directory


@pytest.mark.skipif(not HF, reason="transformers + peft not installed (make corpus-deps)")
@pytest.mark.parametrize("culprit", [1, 0])  # mirrored
def test_watch_names_layer_expert_rank_step_and_counts_in_the_first_screen(tmp_path, culprit):
    """transformers Mixtral + peft + FSDP2: the corpus job whose rank routes layer 1's expert 2
    no token at step 2 (tests/corpus/jobs/hf_moe_lora_fsdp_skip.py), under plain watch."""
    jobs = ROOT / "tests" / "corpus" / "jobs"
    env = job_env(CULPRIT_RANK=str(culprit))
    env["PYTHONPATH"] = os.pathsep.join([str(jobs), env["PYTHONPATH"]])
    proc = run_cli("watch", "--stall", "3", "--out", str(tmp_path / "w"), "--",
                   sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                   "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
                   str(jobs / "hf_moe_lora_fsdp_skip.py"), timeout=300, env=env)
    assert_no_survivors(str(jobs / "hf_moe_lora_fsdp_skip.py"))
    screen = proc.stdout[proc.stdout.index("moe-hang watch:"):].rstrip().splitlines()
    assert proc.returncode == 3 and len(screen) <= 15, proc.stdout[-3000:]
    text = " ".join(line.strip() for line in screen)
    assert (f"routing: rank {culprit} routed 0 of 16 tokens to "
            "model.layers.1.block_sparse_moe expert 2 at step 2 "
            f"(rank {1 - culprit}: ") in text, text
    d = json.loads((tmp_path / "w" / "diagnosis.json").read_text())
    assert d["culprit_ranks"] == [culprit]
    gap = d["routing"]["gaps"][0]
    assert (gap["block"], gap["expert"], gap["step"], gap["routed"][str(culprit)]) == (
        "model.layers.1.block_sparse_moe", 2, 2, 0)


def test_ctrl_c_in_the_middle_of_a_plan_ends_everything(tmp_path):
    """Ctrl-C while a plan's run is under way: one line, exit 130, no process left."""
    out = tmp_path / "c"
    proc = start_cli("check", "--plans", "2", "--out", str(out), "--",
                     *_job("moe_fsdp_train.py", "--steps", "60"))
    try:
        # the plan's ranks running (their heartbeats): on a loaded machine its directory
        # is there long before torch is imported
        ranks = out / "01-starve-e0-r1" / "ranks"
        deadline = time.monotonic() + 120
        while not list(ranks.glob("*.hb.json")) and time.monotonic() < deadline:
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.2)
        assert list(ranks.glob("*.hb.json"))
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err[-2000:]
    # the job's own output passes through (torchrun's KeyboardInterrupt may print one); no
    # traceback of the tool's own
    assert "[error] interrupted" in err, err[-3000:]
    assert not re.search(r"moe_hang/(cli|commands|runtime)", err), err[-3000:]
    assert_no_survivors(str(JOBS / "moe_fsdp_train.py"))
