"""moe-hang check's costs, side by side in one run (nothing here is asserted by the tests):

    python scripts/bench_check.py [--plans 8] [--rounds 5] [--json runs/bench-check.json]

* ``check``: wall time of ``moe-hang check --plans N`` on a user's job (tests/e2e/jobs/
  hf_moe_train.py: transformers Mixtral + peft LoRA + FSDP2 per expert, 2 gloo ranks, 3
  steps), each run's wall time, and how many plans reproduced the hang; the same job under
  plain ``torchrun`` beside it (what one run costs without the tool).
* ``counting``: the cost of counting tokens per expert (probe/routing.py) on the same model in
  one process (no process group; the router hooks are what differs): seconds per training step
  without the hooks, with them, and with a plan applied every step, rounds interleaved, the
  median of each and of the per-round ratio. The global pre-hook that finds the routers lives
  only until the first optimizer step, and is left out (warm-up step).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
JOB = ROOT / "tests" / "e2e" / "jobs" / "hf_moe_train.py"


def _torchrun(*extra: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
            "--standalone", str(JOB), "--steps", "3", *extra]


def bench_check(plans: int) -> dict:
    t0 = time.monotonic()
    subprocess.run(_torchrun(), check=True, capture_output=True, timeout=300)
    plain = time.monotonic() - t0
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "moe_hang.cli", "check", "--plans",
                               str(plans), "--out", f"{tmp}/c", "--json", "--", *_torchrun()],
                              capture_output=True, text=True, timeout=1800)
        wall = time.monotonic() - t0
    d = json.loads(proc.stdout)
    runs = [d["baseline"], *d["plans"]]
    return {"plans": len(d["plans"]), "check_wall_s": round(wall, 1),
            "plain_job_s": round(plain, 1), "exit_code": proc.returncode,
            "reproduced": d["reproduced"],
            "runs": [{"name": "baseline" if r["plan"] is None else r["plan"]["name"],
                      "verdict": r["verdict"], "wall_s": r["wall_s"]} for r in runs]}


def _model():
    import torch
    import transformers as tf

    cfg = tf.MixtralConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                           num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                           num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=0.0)
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")


def _steps(model, n: int) -> float:
    import torch

    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    ids = torch.randint(0, 64, (4, 32), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()  # warm-up (and the routers found)
    opt.step()
    opt.zero_grad()
    t0 = time.perf_counter()
    for _ in range(n):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    return (time.perf_counter() - t0) / n


def per_call_us(n: int = 3000) -> float:
    """One router call's hook alone (top-k, bincount, a line to the file), on a [128, 4]
    logits tensor: the cost the step times above carry per router call."""
    import torch

    from moe_hang.probe.routing import Routing, _Router

    with tempfile.TemporaryDirectory() as tmp:
        r = Routing(torch, 0, Path(tmp, "x.jsonl"))
        r._open(truncate=True)
        gate = torch.nn.Linear(16, 4)
        r._routers[id(gate)] = _Router("model.layers.0.mlp", gate, 4, 2)
        out = torch.randn(128, 4)
        for _ in range(100):
            r._routed(gate, (), out)
        t0 = time.perf_counter()
        for _ in range(n):
            r._routed(gate, (), out)
        return (time.perf_counter() - t0) / n * 1e6


def bench_counting(rounds: int, steps: int) -> dict:
    import torch

    from moe_hang.probe.routing import Routing

    per: dict[str, list[float]] = {"off": [], "counting": [], "plan every step": []}
    with tempfile.TemporaryDirectory() as tmp:
        modes = list(per)
        for i in range(rounds):
            for mode in modes[i % 3:] + modes[:i % 3]:  # each mode first in turn
                model = _model()
                hooks = None
                if mode != "off":
                    hooks = Routing(torch, 0, Path(tmp, f"r{i}{mode}.jsonl"))
                    if mode == "plan every step":
                        hooks.plan = _EveryStep()  # type: ignore[assignment]
                    hooks.install()
                per[mode].append(_steps(model, steps))
                if hooks is not None and hooks._global is not None:
                    hooks._global.remove()
    med = {k: statistics.median(v) for k, v in per.items()}
    ratio = {k: statistics.median(a / b for a, b in zip(v, per["off"], strict=True))
             for k, v in per.items() if k != "off"}
    return {"rounds": rounds, "steps": steps, "step_s": {k: round(v, 6) for k, v in med.items()},
            "ratio_to_off": {k: round(v, 4) for k, v in ratio.items()},
            "per_router_call_us": round(per_call_us(), 1)}


class _EveryStep:
    """A plan that starves expert 1 at every step (the worst case: a bias every call)."""

    starve, all_to, block = 1, None, None

    def applies(self, rank: int, step: int, block: str) -> bool:
        return True


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--plans", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--json", default="runs/bench-check.json")
    ap.add_argument("--only", choices=("check", "counting"))
    args = ap.parse_args()
    if importlib.util.find_spec("transformers") is None:
        sys.exit("needs transformers + peft: make corpus-deps")
    out: dict = {}
    if args.only in (None, "counting"):
        c = out["counting"] = bench_counting(args.rounds, args.steps)
        print(f"\ncounting tokens per expert (Mixtral 2 layers x 4 experts, 128 tokens, "
              f"{c['steps']} steps x {c['rounds']} rounds)")
        print(f"{'mode':<18}{'s/step':>10}{'vs off':>9}")
        for k, v in c["step_s"].items():
            print(f"{k:<18}{v:>10.5f}{c['ratio_to_off'].get(k, 1.0):>9.3f}")
        print(f"one router call's hook alone: {c['per_router_call_us']:.1f} us "
              f"(2 per step here)")
    if args.only in (None, "check"):
        c = out["check"] = bench_check(args.plans)
        print(f"\nmoe-hang check --plans {args.plans} (hf_moe_train.py, 2 gloo ranks, 3 steps)")
        print(f"{'run':<16}{'verdict':<10}{'wall s':>8}")
        for r in c["runs"]:
            print(f"{r['name']:<16}{r['verdict']:<10}{r['wall_s']:>8.1f}")
        print(f"{'check, total':<26}{c['check_wall_s']:>8.1f}   (exit {c['exit_code']}, "
              f"{c['reproduced']} of {c['plans']} plans reproduced)")
        print(f"{'plain torchrun, once':<26}{c['plain_job_s']:>8.1f}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=2))
    print(f"\n-> {args.json}")


if __name__ == "__main__":
    main()
