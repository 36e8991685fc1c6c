"""Expert-parallel (EP) token exchange: the broken gather and the varlen fix.

Every rank of the EP group must post the *same collectives in the same order with the same
sizes*. Routing decides at run time how many tokens each rank holds, so any exchange that
assumes equal counts desyncs the moment the batch is ragged.

``NaiveDTensorDispatch`` is the code path of NeMo Automodel's ``GroupedExpertsLoRA`` before
PR #3631: ``DTensor.from_local(x, mesh, [Shard(0)]).full_tensor()`` exchanges no sizes, so a rank
with 68 tokens posts a 68-row all-gather while a rank with 401 posts a 401-row one. NCCL waits
forever; gloo aborts with "Received data size doesn't match expected size".

``VarlenDispatch`` is the fix (PR #1365, ported to the LoRA path in PR #3631). Collective order
per MoE layer, identical on every rank whatever its token count::

    forward:  exchange_lengths  all_gather [1] int64
              gather_tokens     all_gather [max_T, D]       (x)
              gather_routing    all_gather [max_T, K] x2    (weights, expert ids)
              combine           all_reduce [G, D]
    backward: combine           all_reduce [G, D]           (_CombineVarlen.backward)
              gather_routing    all_reduce [G, K]           (_GatherVarlen.backward)
              gather_tokens     all_reduce [G, D]           (_GatherVarlen.backward)

The backward collectives exist on a rank only if its autograd graph contains the gathers; the
gradient anchor (``anchor_gradients``) guarantees that even when no token reached this rank's
experts. Lift it into your own model with::

    from moe_hang.scenarios.ep import VarlenDispatch
    y_TD = VarlenDispatch(ep_group)(x_TD, weights_TK, experts_TK, local_experts)

Shape suffixes as in :mod:`moe_hang.scenarios.moe`; ``X`` is any trailing width.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from moe_hang.scenarios.moe import local_tensor

# Called just before every EP collective: (step_name, op, input_sizes, dtype, info).
# The repro worker uses it to write per-rank token counts and send sizes to the run directory.
CollectiveObserver = Callable[[str, str, list[list[int]], str, dict[str, Any]], None]
_observer: CollectiveObserver | None = None


def set_collective_observer(fn: CollectiveObserver | None) -> None:
    global _observer
    _observer = fn


def _observe(step: str, op: str, tensors: Sequence[torch.Tensor], **info: Any) -> None:
    if _observer is not None:
        _observer(step, op, [list(t.shape) for t in tensors], str(tensors[0].dtype), info)


def _all_gather_single(out: torch.Tensor, inp: torch.Tensor, group: Any) -> None:
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, inp, group=group)


# ----------------------------------------------------------------------------- broken


class NaiveDTensorDispatch:
    """The broken gather: assumes every EP rank holds the same number of tokens."""

    def __init__(self, mesh: Any):
        self.mesh = mesh

    def __call__(self, x_TD: torch.Tensor, weights_TK: torch.Tensor, experts_TK: torch.Tensor,
                 experts: nn.Module) -> torch.Tensor:
        x_GD = naive_gather(x_TD, self.mesh, "gather_tokens")
        weights_GK = naive_gather(weights_TK, self.mesh, "gather_routing")
        experts_GK = naive_gather(experts_TK, self.mesh, "gather_routing")
        y_GD = experts(x_GD, weights_GK, experts_GK)
        return naive_combine(y_GD, self.mesh)


def naive_gather(x_TX: torch.Tensor, mesh: Any, step: str = "gather_tokens") -> torch.Tensor:
    """``from_local(Shard(0)).full_tensor()``: infers the global shape as ``T * world``.

    With ragged T each rank posts a differently sized all-gather (the deadlock).
    """
    from torch.distributed.tensor import DTensor, Partial, Shard

    world = mesh.size()
    _observe(step, "all_gather", [x_TX], local=x_TX.shape[0],
             assumed_lengths=[x_TX.shape[0]] * world)
    x_dt = DTensor.from_local(x_TX, mesh, [Shard(0)], run_check=False)
    grad_placements = [Partial()] if x_TX.requires_grad else None
    return x_dt.full_tensor(grad_placements=grad_placements)  # the all-gather: T*world rows


def naive_combine(y_GD: torch.Tensor, mesh: Any) -> torch.Tensor:
    """``Partial -> Shard(0)``: a reduce-scatter that splits rows in ``torch.chunk`` layout,
    i.e. at the wrong boundaries whenever the counts are ragged."""
    from torch.distributed.tensor import DTensor, Partial, Shard

    _observe("combine", "reduce_scatter", [y_GD])
    y_dt = DTensor.from_local(y_GD, mesh, [Partial()], run_check=False)
    return y_dt.redistribute(mesh, [Shard(0)]).to_local()


# ----------------------------------------------------------------------------- the fix


def exchange_lengths(num_tokens: int, group: Any, device: torch.device) -> list[int]:
    """All-gather every rank's token count: the one exchange the naive gather skips."""
    world = dist.get_world_size(group)
    n_1 = torch.tensor([num_tokens], dtype=torch.int64, device=device)
    n_W = torch.empty(world, dtype=torch.int64, device=device)
    _observe("exchange_lengths", "all_gather", [n_1], local=num_tokens)
    _all_gather_single(n_W, n_1, group)
    return [int(n) for n in n_W.tolist()]


def _gather_padded(x_TX: torch.Tensor, lengths: list[int], group: Any,
                   step: str) -> torch.Tensor:
    """Pad to the longest rank, all-gather equal-sized pieces, trim each to its true length."""
    world, max_t = len(lengths), max(lengths)
    x_MX = x_TX.new_zeros((max_t, *x_TX.shape[1:]))
    x_MX[: x_TX.shape[0]] = x_TX
    out_WMX = x_TX.new_empty((world * max_t, *x_TX.shape[1:]))
    _observe(step, "all_gather", [x_MX], local=x_TX.shape[0], lengths=lengths)
    _all_gather_single(out_WMX, x_MX.contiguous(), group)
    pieces = [out_WMX[r * max_t : r * max_t + n] for r, n in enumerate(lengths)]
    return torch.cat(pieces, dim=0)


def _my_rows(lengths: list[int], group: Any) -> tuple[int, int]:
    rank = dist.get_rank(group)
    return sum(lengths[:rank]), lengths[rank]


def sum_gathered_grads(grad_GX: torch.Tensor, lengths: list[int], group: Any,
                       step: str) -> torch.Tensor:
    """Backward of a gather: every rank's experts contributed to every row; sum, keep mine."""
    grad_GX = grad_GX.contiguous()
    _observe(step, "all_reduce", [grad_GX], backward=True, lengths=lengths,
             autograd_fn="_GatherVarlen")
    dist.all_reduce(grad_GX, group=group)
    start, n = _my_rows(lengths, group)
    return grad_GX.narrow(0, start, n)


class _GatherVarlen(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x_TX: torch.Tensor, lengths: list[int], group: Any,
                step: str) -> torch.Tensor:
        ctx.lengths, ctx.group, ctx.step = lengths, group, step
        return _gather_padded(x_TX, lengths, group, step)

    @staticmethod
    def backward(ctx: Any, grad_GX: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return sum_gathered_grads(grad_GX, ctx.lengths, ctx.group, ctx.step), None, None, None


def gather_tokens(x_TD: torch.Tensor, lengths: list[int], group: Any) -> torch.Tensor:
    """Varlen all-gather of the tokens: ``x_GD`` holds every rank's rows, in rank order."""
    return _GatherVarlen.apply(x_TD, lengths, group, "gather_tokens")


def gather_routing(weights_TK: torch.Tensor, experts_TK: torch.Tensor, lengths: list[int],
                   group: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Varlen all-gather of the routing weights (with autograd) and expert ids (without)."""
    weights_GK = _GatherVarlen.apply(weights_TK, lengths, group, "gather_routing")
    experts_GK = _gather_padded(experts_TK, lengths, group, "gather_routing")
    return weights_GK, experts_GK


def spread_output_grads(grad_TD: torch.Tensor, lengths: list[int], group: Any) -> torch.Tensor:
    """Backward of combine: place my rows' gradient in a zero ``[G, D]`` and sum over ranks, so
    every rank's local experts see the gradient of every row they produced."""
    start, n = _my_rows(lengths, group)
    grad_GD = grad_TD.new_zeros((sum(lengths), *grad_TD.shape[1:]))
    grad_GD[start : start + n] = grad_TD
    _observe("combine", "all_reduce", [grad_GD], backward=True, lengths=lengths,
             autograd_fn="_CombineVarlen")
    dist.all_reduce(grad_GD, group=group)
    return grad_GD


class _CombineVarlen(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, y_GD: torch.Tensor, lengths: list[int], group: Any) -> torch.Tensor:
        ctx.lengths, ctx.group = lengths, group
        y_GD = y_GD.clone()
        _observe("combine", "all_reduce", [y_GD], lengths=lengths)
        dist.all_reduce(y_GD, group=group)
        start, n = _my_rows(lengths, group)
        return y_GD.narrow(0, start, n).clone()

    @staticmethod
    def backward(ctx: Any, grad_TD: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return spread_output_grads(grad_TD, ctx.lengths, ctx.group), None, None


def combine(y_GD: torch.Tensor, lengths: list[int], group: Any) -> torch.Tensor:
    """Sum every rank's partial expert outputs (all-reduce) and keep this rank's rows."""
    return _CombineVarlen.apply(y_GD, lengths, group)


def anchor_gradients(y_GD: torch.Tensor, *tensors: torch.Tensor) -> torch.Tensor:
    """``y += x.sum() * 0``: make the output depend on every gathered input (and on the local
    trainable parameters).

    A rank whose local experts received no token would otherwise compute ``y`` without touching
    ``x_GD``; autograd would then never run the gathers' backward all-reduce there while the
    other ranks do, and the hang moves from the forward into the backward. Tying ``y`` to the
    local LoRA parameters too keeps ``combine``'s backward in the graph in the first layer,
    whose input needs no gradient.
    """
    zero = sum((t.sum() for t in tensors if t.requires_grad), y_GD.new_zeros(()))
    return y_GD + zero * 0


class VarlenDispatch:
    """The fix: exchange lengths, pad + all-gather + trim, experts, anchor, all-reduce + narrow."""

    def __init__(self, group: Any, anchor: bool = True):
        self.group, self.anchor = group, anchor

    def __call__(self, x_TD: torch.Tensor, weights_TK: torch.Tensor, experts_TK: torch.Tensor,
                 experts: nn.Module) -> torch.Tensor:
        lengths = exchange_lengths(x_TD.shape[0], self.group, x_TD.device)
        x_GD = gather_tokens(x_TD, lengths, self.group)
        weights_GK, experts_GK = gather_routing(weights_TK, experts_TK, lengths, self.group)
        y_GD = experts(x_GD, weights_GK, experts_GK)
        if self.anchor:
            params = [local_tensor(p) for p in experts.parameters() if p.requires_grad]
            y_GD = anchor_gradients(y_GD, x_GD, weights_GK, *params)
        return combine(y_GD, lengths, self.group)
