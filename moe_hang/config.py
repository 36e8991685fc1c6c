"""Run configuration: parsing and validation of what the user asked for (no torch here).

One :class:`RunConfig` per repro/verify run, the model's :class:`ModelConfig` nested in it.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any

from moe_hang.errors import MoeHangError
from moe_hang.scenarios.registry import FIXES, SCENARIOS, default_tokens

BACKENDS = ("auto", "gloo", "nccl")
VARIANTS = ("broken", "fixed")
DEFAULT_STALL_S = 3.0
DEFAULT_PG_TIMEOUT_S = 60.0
MAX_NPROC = 64


@dataclass(frozen=True)
class ModelConfig:
    """The 2-layer MoE + LoRA model (:mod:`moe_hang.scenarios.moe`): identical on every rank
    and in the single-process reference, so weights come from the seed, not from a scatter."""

    hidden: int = 64
    ffn: int = 128
    experts: int = 4
    topk: int = 2
    lora_rank: int = 8
    lora_alpha: float = 16.0
    layers: int = 2
    seed: int = 0
    dead_experts: tuple[int, ...] = ()  # experts no token is routed to
    dead_layers: tuple[int, ...] = ()  # where dead_experts apply; empty: every layer

    def dead_in(self, layer: int) -> tuple[int, ...]:
        return self.dead_experts if not self.dead_layers or layer in self.dead_layers else ()

    @property
    def lora_scale(self) -> float:
        return self.lora_alpha / self.lora_rank


def parse_tokens(text: str) -> list[int]:
    """Parse ``--tokens 68,401`` into per-rank counts; one clear error for anything else."""
    parts = [p.strip() for p in text.split(",")]
    if not text.strip() or any(p == "" for p in parts):
        raise MoeHangError(f"--tokens {text!r}: expected comma-separated counts like 68,401")
    counts: list[int] = []
    for p in parts:
        try:
            n = int(p)
        except ValueError:
            raise MoeHangError(
                f"--tokens {text!r}: {p!r} is not a whole number (expected e.g. 68,401)"
            ) from None
        if n < 0:
            raise MoeHangError(f"--tokens {text!r}: token counts cannot be negative ({n})")
        counts.append(n)
    return counts


@dataclass
class RunConfig:
    """Everything one repro/verify run needs; written to ``config.json`` in the run directory
    and read back by every rank, so the parent and the workers agree on the scenario without
    passing long argument lists."""

    scenario: str = "ep-ragged"
    variant: str = "broken"  # broken | fixed
    fix: str = "varlen"  # varlen | a2a | all-experts (used when variant == fixed)
    nproc: int = 2
    tokens: list[int] = field(default_factory=lambda: default_tokens(2))
    backend: str = "auto"
    stall_s: float = DEFAULT_STALL_S
    pg_timeout_s: float = DEFAULT_PG_TIMEOUT_S
    steps: int = 3
    lr: float = 0.1
    port: int | None = None
    # fsdp-skip: wrap LoRA outside fully_shard (the coverage mistake verify must catch)
    lora_outside_fsdp: bool = False
    # verify --fixed: every step's output, loss share and whole LoRA gradients in result.pt
    keep_results: bool = False
    model: ModelConfig = field(default_factory=ModelConfig)

    @property
    def world(self) -> int:
        return self.nproc

    @property
    def total_tokens(self) -> int:
        return sum(self.tokens)

    @property
    def label(self) -> str:
        """The run directory's suffix: ``ep-ragged-broken``, ``ep-ragged-fixed-varlen``."""
        return f"{self.scenario}-{self.variant}" + (
            f"-{self.fix}" if self.variant == "fixed" else "")

    def offsets(self) -> list[int]:
        """Rank r owns rows ``[offsets[r], offsets[r] + tokens[r])`` of the global batch."""
        out, acc = [], 0
        for n in self.tokens:
            out.append(acc)
            acc += n
        return out

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunConfig:
        names = {f.name for f in dataclasses.fields(cls)} - {"model"}
        model_names = {f.name for f in dataclasses.fields(ModelConfig)}
        raw = data.get("model") or {}
        fields: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v
                                  for k, v in raw.items() if k in model_names}
        model = ModelConfig(**fields)
        return cls(model=model, **{k: v for k, v in data.items() if k in names})


def build_config(
    *,
    scenario: str = "ep-ragged",
    variant: str = "broken",
    fix: str | None = None,
    nproc: int | None = None,
    tokens: str | None = None,
    backend: str = "auto",
    stall_s: float = DEFAULT_STALL_S,
    steps: int | None = None,
    hidden: int = 64,
    ffn: int = 128,
    experts: int | None = None,
    topk: int = 2,
    lora_rank: int = 8,
    lora_alpha: float = 16.0,
    seed: int = 0,
    dead_experts: str | None = None,
    dead_layers: str | None = None,
    port: int | None = None,
    pg_timeout_s: float = DEFAULT_PG_TIMEOUT_S,
    lora_outside_fsdp: bool = False,
) -> RunConfig:
    """Validate the user's options and fill in defaults; raises :class:`MoeHangError`."""
    if scenario not in SCENARIOS:
        raise MoeHangError(f"unknown scenario {scenario!r}; choose one of {', '.join(SCENARIOS)}")
    spec = SCENARIOS[scenario]
    allowed = spec.fixes
    fix = fix or allowed[0]
    if fix not in FIXES:
        raise MoeHangError(f"unknown fix {fix!r}; choose one of {', '.join(FIXES)}")
    if fix not in allowed:
        raise MoeHangError(f"--fix {fix} does not apply to {scenario}; "
                           f"choose {' or '.join(allowed)}")
    if backend not in BACKENDS:
        raise MoeHangError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    counts = parse_tokens(tokens) if tokens is not None else None
    if nproc is not None and nproc < 1:
        raise MoeHangError(f"--nproc {nproc}: need at least 1 rank")
    if nproc is not None and nproc > MAX_NPROC:
        raise MoeHangError(f"--nproc {nproc}: at most {MAX_NPROC} ranks on one machine")
    if counts is None:
        world = nproc if nproc is not None else 2
        counts = default_tokens(world, scenario)
    else:
        world = nproc if nproc is not None else len(counts)
        if len(counts) != world:
            raise MoeHangError(
                f"--tokens has {len(counts)} count(s) but --nproc is {world}: "
                "give one count per rank"
            )
    if world < spec.min_ranks:
        raise MoeHangError(f"--nproc {world}: expert parallelism needs at least 2 ranks")
    if sum(counts) < 1:
        raise MoeHangError(f"--tokens {tokens}: the batch needs at least one token in total")
    n_experts = experts if experts is not None else 2 * world
    if n_experts < 1 or n_experts % world:
        raise MoeHangError(
            f"--experts {n_experts}: must be a positive multiple of the {world} ranks "
            "(each rank owns experts/world experts)"
        )
    dead = parse_expert_list(dead_experts, n_experts) if dead_experts else []
    layers_dead = parse_index_list(dead_layers, 2, "--dead-layers") if dead_layers else []
    if scenario == "ep-no-anchor" and dead_experts is None:
        # in the last layer no token anywhere reaches the last rank's experts
        per = n_experts // world
        dead = list(range(n_experts - per, n_experts))
        layers_dead = layers_dead or [1]
    if steps is None:
        steps = spec.steps
    if topk < 1 or topk > n_experts - len(dead):
        raise MoeHangError(
            f"--topk {topk}: must be between 1 and the {n_experts - len(dead)} routable experts"
        )
    sizes = (("steps", steps), ("hidden", hidden), ("ffn", ffn), ("lora-rank", lora_rank))
    for name, value in sizes:
        if value < 1:
            raise MoeHangError(f"--{name} {value}: must be at least 1")
    if stall_s <= 0:
        raise MoeHangError(f"--stall {stall_s}: must be a positive number of seconds")
    if port is not None and not (1 <= port <= 65535):
        raise MoeHangError(f"--port {port}: not a TCP port")
    return RunConfig(
        scenario=scenario, variant=variant, fix=fix, nproc=world, tokens=counts,
        backend=backend, stall_s=stall_s, pg_timeout_s=pg_timeout_s, steps=steps, port=port,
        lora_outside_fsdp=lora_outside_fsdp,
        model=ModelConfig(hidden=hidden, ffn=ffn, experts=n_experts, topk=topk,
                          lora_rank=lora_rank, lora_alpha=lora_alpha, seed=seed,
                          dead_experts=tuple(dead), dead_layers=tuple(layers_dead)))


# Prints the CUDA version torch was built with ('' for a CPU build) and the devices it sees.
_COUNT_GPUS = ("import torch; c = torch.version.cuda; "
               "print(c or ''); print(torch.cuda.device_count() if c else 0)")


def require_gpu_per_rank(nproc: int, *, timeout_s: float,
                         python: str = sys.executable) -> None:
    """``--backend nccl`` needs a CUDA build of torch and one GPU per rank; refused before
    anything is launched, instead of every rank failing in init_process_group. Asked of a
    short subprocess (bounded by ``timeout_s``: ``Settings.gpu_check_timeout_s``), and only
    when nccl is requested: importing torch here would cost every command about 2 s."""
    try:
        proc = subprocess.run([python, "-c", _COUNT_GPUS], capture_output=True, text=True,
                              timeout=timeout_s, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise MoeHangError(f"--backend nccl: could not count the GPUs within {timeout_s:.0f} s "
                           "(torch.cuda.device_count() did not return)") from None
    except OSError as exc:
        raise MoeHangError(f"--backend nccl: cannot run {python} ({exc.strerror})") from None
    lines = proc.stdout.splitlines()[-2:]  # the last two: whatever torch may print first
    if proc.returncode != 0 or len(lines) != 2 or not lines[1].strip().isdigit():
        why = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise MoeHangError(f"--backend nccl: cannot ask torch for GPUs ({why[:200]})")
    cuda, count = lines[0].strip(), int(lines[1])
    if not cuda:
        raise MoeHangError("--backend nccl: this torch is a CPU-only build "
                           "(torch.version.cuda is None); use --backend gloo")
    if count < nproc:
        raise MoeHangError(f"--backend nccl: {nproc} ranks need a GPU each, but CUDA sees "
                           f"{count}; use --backend gloo" + (f" or --nproc {count}"
                                                             if count else ""))


def parse_index_list(text: str, n: int, option: str) -> list[int]:
    out: list[int] = []
    for p in text.split(","):
        try:
            i = int(p.strip())
        except ValueError:
            raise MoeHangError(f"{option} {text!r}: {p.strip()!r} is not an index") from None
        if not 0 <= i < n:
            raise MoeHangError(f"{option} {text!r}: {i} is not in 0..{n - 1}")
        out.append(i)
    return sorted(set(out))


def parse_expert_list(text: str, n_experts: int) -> list[int]:
    return parse_index_list(text, n_experts, "--dead-experts")
