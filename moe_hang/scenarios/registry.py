"""The scenarios the tool reproduces, one record each: the broken build, the fixes that apply
(the first is the default), the defaults that make it hang deterministically, and the advice
the report gives (docs/DESIGN.md §1). Pure: read by config validation and the commands without
importing torch; :mod:`moe_hang.scenarios.build` turns a record into a model inside a rank.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

# verify --fixed's single-process reference: moe_hang.check's runner (usercheck/reference.py)
# on these (scenarios/reference.py), told the run's config.json by this variable
REFERENCE_BUILD = "moe_hang.scenarios.reference:reference"
REFERENCE_BATCH = "moe_hang.scenarios.reference:batch"
ENV_RUN_CONFIG = "MOE_HANG_RUN_CONFIG"

# Fixed ragged patterns, so the same command routes the same tokens on every machine.
# 68/401/1607 are the per-rank counts from the NeMo Automodel report (PR #3631).
_RAGGED = (68, 401, 1607, 230, 911, 5, 1203, 333)


def _ragged_tokens(nproc: int) -> list[int]:
    if nproc == 2:
        return [68, 401]
    return [_RAGGED[i % len(_RAGGED)] + 17 * (i // len(_RAGGED)) for i in range(nproc)]


def _fsdp_tokens(nproc: int) -> list[int]:
    # rank 0 holds few tokens: steps 1-4 reach every expert on every rank; step 5 routes
    # none of rank 0's tokens to expert 2 of layer 1 (checked in tests/e2e/test_scenarios.py)
    return [8] + [64] * (nproc - 1)


@dataclass(frozen=True)
class Fix:
    name: str
    describe: str  # what runs when it is under test


@dataclass(frozen=True)
class Scenario:
    name: str
    broken: str  # the exchange the broken variant builds (see scenarios.build)
    fixes: tuple[str, ...]  # names in FIXES; the first is the default
    steps: int  # default number of training steps
    tokens: Callable[[int], list[int]]  # default per-rank token counts for N ranks
    hint: str  # the fix, in one or two sentences, for the report of the broken variant
    min_ranks: int = 2


FIXES: dict[str, Fix] = {f.name: f for f in (
    Fix("varlen", "varlen (moe_hang.VarlenDispatch): exchange lengths, pad + all-gather + "
                  "trim, gradient anchor, all-reduce + narrow"),
    Fix("a2a", "a2a (moe_hang.AllToAllDispatch): per-expert counts, all-to-all dispatch "
               "to the owning rank, experts, reverse all-to-all, combine"),
    Fix("all-experts", "all-experts (moe_hang.FSDPExperts(call_all=True)): every expert "
                       "is called every step, on an empty input where it has no token"),
)}

SCENARIOS: dict[str, Scenario] = {s.name: s for s in (
    Scenario(
        "ep-ragged", broken="naive", fixes=("varlen", "a2a"), steps=3, tokens=_ragged_tokens,
        hint=("Replace DTensor.from_local(x, mesh, [Shard(0)]).full_tensor() with the varlen "
              "exchange: all-gather lengths, pad + all-gather + trim, gradient anchor, "
              "all-reduce + narrow (moe_hang.VarlenDispatch; NeMo Automodel PR #3631).")),
    Scenario(
        "ep-no-anchor", broken="varlen-no-anchor", fixes=("varlen", "a2a"), steps=3,
        tokens=_ragged_tokens,
        hint=("Add the gradient anchor y = y + x.sum() * 0 after the local experts "
              "(moe_hang.anchor_gradients) so every rank's backward runs the gathers' "
              "all-reduce even when no token reached its experts.")),
    Scenario(
        "fsdp-skip", broken="fsdp-skip", fixes=("all-experts",), steps=5, tokens=_fsdp_tokens,
        hint=("Call every expert every step, with an empty input where this rank routed it "
              "no token (moe_hang.FSDPExperts(call_all=True)), so FSDP's all-gather "
              "runs on every rank; keep each expert's LoRA inside the same fully_shard unit "
              "as the weights it adapts (apply LoRA before fully_shard)."),
        min_ranks=1),
)}


def default_tokens(nproc: int, scenario: str = "ep-ragged") -> list[int]:
    """The default ragged per-rank token counts for ``nproc`` ranks."""
    return SCENARIOS[scenario].tokens(nproc)


def recommend_fix(scenario: str, experts: int, topk: int, nproc: int) -> tuple[str, str]:
    """varlen for few experts per token; a2a once E/k is large, with the reason."""
    default = SCENARIOS[scenario].fixes[0]
    if "a2a" not in SCENARIOS[scenario].fixes:
        return default, ""
    ratio = experts / topk
    if ratio < 4:
        return default, ""
    w = nproc
    return "a2a", (
        f"With E/k = {experts}/{topk} = {ratio:g}, prefer the all-to-all fix "
        "(--fix a2a, moe_hang.AllToAllDispatch): it sends each token only to the ranks of "
        f"its {topk} experts (about 2·k·T·D per rank per layer), where varlen gathers "
        f"every token to all {w} ranks and all-reduces a full-size output (about "
        f"{w}·T·D·(1 + 2·{w - 1}/{w})); prove it with moe-hang verify --fixed --fix a2a.")
