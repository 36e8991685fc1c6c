"""The all-to-all token dispatcher: the fix that scales (as Megatron-Core's and torchtitan's).

The varlen fix gathers every token to every rank and all-reduces a full-size output, so its
traffic grows with the number of ranks and ignores top-k. Here each (token, expert) pair goes
only to the rank that owns the expert, and only the results come back. Collective order per
MoE layer, identical on every rank whatever its token counts (zero included)::

    forward:  exchange_counts   all_to_all [W] int64        pairs this rank sends to each rank
              dispatch_tokens   all_to_all [sent, D]        (x rows, one per (token, expert))
              dispatch_tokens   all_to_all [sent]  int64    (expert ids)
              return_tokens     all_to_all [received, D]    (expert outputs, back to the source)
    backward: return_tokens     all_to_all  (reverse splits)   (_AllToAll.backward)
              dispatch_tokens   all_to_all  (reverse splits)   (_AllToAll.backward)

The routing weights are applied on the source rank after the results come back, so their
gradient never crosses ranks. As in the varlen fix, a gradient anchor ties the experts' output
to what they received and to their trainable parameters, so every rank's backward posts both
all-to-alls even when its experts received nothing.

    from moe_hang.scenarios.a2a import AllToAllDispatch
    y_TD = AllToAllDispatch(ep_group, num_local)(x_TD, weights_TK, experts_TK, local_experts)

Shape suffixes as in :mod:`moe_hang.scenarios.moe`; ``P`` = (token, expert) pairs this rank sends,
``R`` = pairs it receives.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from moe_hang.scenarios.ep import _observe, anchor_gradients
from moe_hang.scenarios.moe import local_tensor


def _all_to_all(out: torch.Tensor, inp: torch.Tensor, out_splits: list[int],
                in_splits: list[int], group: Any) -> None:
    dist.all_to_all_single(out, inp.contiguous(), output_split_sizes=out_splits,
                           input_split_sizes=in_splits, group=group)


class _AllToAll(torch.autograd.Function):
    """Rows ``in_splits[r]`` go to rank r; the backward sends gradients back the same way."""

    @staticmethod
    def forward(ctx: Any, x_PX: torch.Tensor, in_splits: list[int], out_splits: list[int],
                group: Any, step: str) -> torch.Tensor:
        ctx.in_splits, ctx.out_splits, ctx.group, ctx.step = in_splits, out_splits, group, step
        out = x_PX.new_empty((sum(out_splits), *x_PX.shape[1:]))
        _observe(step, "all_to_all", [x_PX], in_splits=in_splits, out_splits=out_splits)
        _all_to_all(out, x_PX, out_splits, in_splits, group)
        return out

    @staticmethod
    def backward(ctx: Any, grad_RX: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grad = grad_RX.new_empty((sum(ctx.in_splits), *grad_RX.shape[1:]))
        _observe(ctx.step, "all_to_all", [grad_RX], backward=True, in_splits=ctx.out_splits,
                 out_splits=ctx.in_splits, autograd_fn="_AllToAll")
        _all_to_all(grad, grad_RX, ctx.in_splits, ctx.out_splits, ctx.group)
        return grad, None, None, None, None


def exchange_counts(send_W: torch.Tensor, group: Any) -> list[int]:
    """How many (token, expert) pairs every rank sends me: an all-to-all of the counts."""
    recv_W = torch.empty_like(send_W)
    _observe("exchange_counts", "all_to_all", [send_W], send=send_W.tolist())
    _all_to_all(recv_W, send_W, [1] * send_W.numel(), [1] * send_W.numel(), group)
    return [int(n) for n in recv_W.tolist()]


def dispatch_tokens(x_PD: torch.Tensor, experts_P: torch.Tensor, send: list[int],
                    recv: list[int], group: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Send each pair's row and expert id to the rank that owns the expert."""
    x_RD = _AllToAll.apply(x_PD, send, recv, group, "dispatch_tokens")
    experts_R = experts_P.new_empty(sum(recv))
    _observe("dispatch_tokens", "all_to_all", [experts_P], in_splits=send, out_splits=recv)
    _all_to_all(experts_R, experts_P, recv, send, group)
    return x_RD, experts_R


def return_tokens(y_RD: torch.Tensor, send: list[int], recv: list[int],
                  group: Any) -> torch.Tensor:
    """Send every expert output back to the rank its token came from (the reverse splits)."""
    return _AllToAll.apply(y_RD, recv, send, group, "return_tokens")


class AllToAllDispatch:
    """The scalable fix: each (token, expert) pair travels to its expert's rank and back."""

    def __init__(self, group: Any, num_local: int):
        self.group, self.num_local = group, num_local

    def __call__(self, x_TD: torch.Tensor, weights_TK: torch.Tensor, experts_TK: torch.Tensor,
                 experts: nn.Module) -> torch.Tensor:
        world = dist.get_world_size(self.group)
        T, K = experts_TK.shape
        experts_P = experts_TK.reshape(-1)
        dest_P = torch.div(experts_P, self.num_local, rounding_mode="floor")
        order_P = torch.argsort(dest_P, stable=True)  # group the pairs by destination rank
        token_P = torch.arange(T, device=x_TD.device).repeat_interleave(K)[order_P]
        send_W = torch.bincount(dest_P, minlength=world).to(torch.int64)
        send = [int(n) for n in send_W.tolist()]
        recv = exchange_counts(send_W, self.group)
        x_RD, experts_R = dispatch_tokens(x_TD[token_P], experts_P[order_P], send, recv,
                                          self.group)
        # every received row has weight 1 here; the routing weight is applied at the source
        ones_R1 = x_RD.new_ones((x_RD.shape[0], 1))
        y_RD = experts(x_RD, ones_R1, experts_R.unsqueeze(1))
        params = [local_tensor(p) for p in experts.parameters() if p.requires_grad]
        y_RD = anchor_gradients(y_RD, x_RD, *params)
        y_PD = return_tokens(y_RD, send, recv, self.group)
        w_P1 = weights_TK.reshape(-1)[order_P].unsqueeze(1)
        return torch.zeros_like(x_TD).index_add(0, token_P, y_PD * w_P1)
