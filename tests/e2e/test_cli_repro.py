"""End to end through the real CLI and real torchrun: repro, verify, and bad input."""

from __future__ import annotations

import json
import socket
import stat
from pathlib import Path

import pytest
from conftest import ROOT, assert_no_survivors, load_json, run_cli

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]


def _line_of(path: Path, needle: str) -> int:
    for i, line in enumerate(path.read_text().splitlines(), start=1):
        if needle in line:
            return i
    raise AssertionError(f"{needle!r} not in {path}")


def _json(proc) -> dict:
    assert proc.stdout.strip(), proc.stderr
    return json.loads(proc.stdout)


def test_repro_reproduces_the_ragged_gather(tmp_path):
    run = tmp_path / "run"
    proc = run_cli("repro", "--out", str(run), "--json")
    assert proc.returncode == 3, proc.stderr
    d = _json(proc)
    assert d["verdict"] == "desync" and d["scenario"] == "ep-ragged" and d["variant"] == "broken"
    fd = d["first_divergence"]
    assert fd["kind"] == "size_mismatch" and fd["pg"] == "0" and fd["seq"] == 1
    assert fd["per_rank"]["0"]["op"] == "all_gather"
    assert fd["per_rank"]["0"]["input_sizes"] == [[68, 64]]
    assert fd["per_rank"]["1"]["input_sizes"] == [[401, 64]]
    gather_line = _line_of(ROOT / "moe_hang" / "scenarios" / "ep.py",
                           ".full_tensor(grad_placements=")
    for r in ("0", "1"):  # the line each rank posted the diverging collective from
        site = fd["per_rank"][r]["callsite"]
        assert site["function"] == "naive_gather" and site["line"] == gather_line
        assert site["file"].endswith("moe_hang/scenarios/ep.py")
    for r in d["ranks"]:
        # where each rank is now: rank 0 is held in the gather (rank 1 may be further on)
        if r["rank"] == 0:
            assert r["callsite"]["function"] == "naive_gather"
        assert r["tokens"]["local"] == [68, 401][r["rank"]]
        assert len(r["tokens"]["per_expert"]) == 4
    assert d["timings"]["onset_to_verdict_s"] < 30
    # everything is on disk, privately
    for name in ("meta.json", "config.json", "diagnosis.json", "console.log", "job.log",
                 "processes.json", "ranks/rank0.tokens.jsonl", "ranks/rank1.tokens.jsonl"):
        assert (run / name).exists(), name
    assert stat.S_IMODE(run.stat().st_mode) == 0o700
    assert load_json(run / "diagnosis.json")["verdict"] == "desync"
    console = (run / "console.log").read_text()
    assert "DESYNC" in console and "naive_gather" in console and "68×64" in console
    assert not list((run / "ranks").glob("*.ctl"))
    assert_no_survivors(str(run))


def test_repro_human_output_and_html(tmp_path):
    run = tmp_path / "run"
    html = tmp_path / "report.html"
    proc = run_cli("repro", "--out", str(run), "--html", str(html), "--verbose")
    assert proc.returncode == 3, proc.stderr
    out = proc.stdout
    for needle in ("moe-hang repro: DESYNC", "size_mismatch", "68×64", "401×64",
                   "naive_gather", "VarlenDispatch", "rank", "collectives of default_pg"):
        assert needle in out, needle
    page = html.read_text()
    assert page.lstrip().startswith("<!DOCTYPE html>") and "DESYNC" in page
    assert "Traceback" not in out + proc.stderr
    assert_no_survivors(str(run))


def test_uniform_tokens_rule_the_hang_out(tmp_path):
    run = tmp_path / "run"
    proc = run_cli("repro", "--tokens", "128,128", "--out", str(run), "--json")
    assert proc.returncode == 0, proc.stderr
    d = _json(proc)
    assert d["verdict"] == "healthy" and d["reproduced"] is False
    assert_no_survivors(str(run))


def test_verify_fixed_matches_the_reference(tmp_path):
    run = tmp_path / "run"
    proc = run_cli("verify", "--fixed", "--out", str(run), "--json")
    assert proc.returncode == 0, proc.stderr + proc.stdout
    d = _json(proc)
    assert d["verdict"] == "healthy" and d["verified"] is True and d["variant"] == "fixed"
    ref = d["reference"]
    assert ref["ok"] and ref["max_abs_err"] <= ref["tolerance"] and ref["rtol"] <= 1e-5
    assert ref["compared"] >= 2 * 3 * 10  # ranks × steps × (output, loss, 8 LoRA grads)
    assert all(r["exit_code"] == 0 for r in d["ranks"])
    assert_no_survivors(str(run))


def test_verify_fixed_with_an_empty_rank_and_a_dead_expert(tmp_path):
    run = tmp_path / "run"
    proc = run_cli("verify", "--fixed", "--tokens", "0,5", "--dead-experts", "3",
                   "--out", str(run), "--json")
    assert proc.returncode == 0, proc.stderr + proc.stdout
    d = _json(proc)
    assert d["reference"]["ok"]
    tokens = {r["rank"]: r["tokens"] for r in d["ranks"]}
    assert tokens[0]["local"] == 0
    assert tokens[1]["per_expert"][3] == 0
    assert_no_survivors(str(run))


def test_verify_without_fixed_confirms_the_repro(tmp_path):
    run = tmp_path / "run"
    proc = run_cli("verify", "--out", str(run), "--json")
    assert proc.returncode == 0, proc.stderr
    assert _json(proc)["reproduced"] is True
    assert_no_survivors(str(run))


# ----------------------------------------------------------------------------- bad input


def _one_line_error(proc, needle: str) -> None:
    assert proc.returncode == 1, (proc.returncode, proc.stderr)
    err = proc.stderr.strip()
    assert err.startswith("[error] ") and "\n" not in err and "Traceback" not in err, err
    assert needle in err, err


@pytest.mark.parametrize("args,needle", [
    (["--tokens", "abc"], "not a whole number"),
    (["--tokens", "68,-1"], "negative"),
    (["--nproc", "3", "--tokens", "1,2"], "one count per rank"),
    (["--nproc", "0"], "at least 1 rank"),
    (["--tokens", "0,0"], "at least one token"),
    (["--scenario", "bogus"], "unknown scenario"),
])
def test_bad_options_are_one_line_errors(tmp_path, args, needle):
    _one_line_error(run_cli("repro", *args, "--out", str(tmp_path / "r"), timeout=60), needle)
    assert not (tmp_path / "r").exists()


def test_busy_port_is_a_clear_error(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        _one_line_error(run_cli("repro", "--port", str(port), "--out", str(tmp_path / "r"),
                                timeout=60), f"port {port} is busy")


def test_out_that_is_a_file_or_holds_a_run_is_refused(tmp_path):
    f = tmp_path / "afile"
    f.write_text("mine")
    _one_line_error(run_cli("repro", "--out", str(f), timeout=60), "not a directory")
    assert f.read_text() == "mine"
    prev = tmp_path / "prev"
    prev.mkdir()
    (prev / "diagnosis.json").write_text('{"mine": 1}')
    _one_line_error(run_cli("repro", "--out", str(prev), timeout=60), "already holds a run")
    assert (prev / "diagnosis.json").read_text() == '{"mine": 1}'


def test_unknown_option_is_a_usage_error():
    proc = run_cli("repro", "--bogus", timeout=60)
    assert proc.returncode == 2
