"""The varlen gather/combine at 2 real gloo ranks, forward and backward, against a reference."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from conftest import spawn_ranks

from moe_hang.scenarios import ep

pytestmark = [pytest.mark.dist, pytest.mark.timeout(120)]


def _inputs(counts, d=4):
    g = torch.Generator().manual_seed(1234)
    X = torch.randn(sum(counts), d, generator=g, dtype=torch.float64)
    W = torch.randn(len(counts), d, generator=g, dtype=torch.float64)  # one "expert" per rank
    C = torch.randn(sum(counts), d, generator=g, dtype=torch.float64)
    return X, W, C


def _expert(x_GD, w_D, rank, skip_rank):
    # rank `skip_rank` has no token for its expert: its output does not depend on x at all
    if rank == skip_rank:
        return torch.zeros_like(x_GD)
    return torch.tanh(x_GD * w_D)


def _worker(rank, world, counts, skip_rank):
    X, W, C = _inputs(counts)
    off = sum(counts[:rank])
    rows = slice(off, off + counts[rank])
    x_TD = X[rows].clone().requires_grad_(True)
    w_D = W[rank].clone().requires_grad_(True)
    group = dist.group.WORLD

    lengths = ep.exchange_lengths(x_TD.shape[0], group, x_TD.device)
    assert lengths == list(counts)
    x_GD = ep.gather_tokens(x_TD, lengths, group)
    assert torch.equal(x_GD.detach(), X)  # every rank sees every row, in rank order
    ids_GK = ep._gather_padded(torch.arange(counts[rank]).unsqueeze(1) + off, lengths,
                               group, "ids")
    assert torch.equal(ids_GK.squeeze(1), torch.arange(sum(counts)))
    y_GD = _expert(x_GD, w_D, rank, skip_rank)
    y_GD = ep.anchor_gradients(y_GD, x_GD, w_D)
    y_TD = ep.combine(y_GD, lengths, group)
    loss = (y_TD * C[rows]).sum()
    loss.backward()

    # reference: one process, all experts
    Xr = X.clone().requires_grad_(True)
    Wr = W.clone().requires_grad_(True)
    Y = sum(_expert(Xr, Wr[r], r, skip_rank) for r in range(world))
    (Y * C).sum().backward()
    assert torch.allclose(y_TD.detach(), Y.detach()[rows], atol=1e-12)
    assert torch.allclose(x_TD.grad, Xr.grad[rows], atol=1e-12)
    assert torch.allclose(w_D.grad, Wr.grad[rank], atol=1e-12)


@pytest.mark.parametrize("counts,skip_rank", [((3, 2), -1), ((0, 5), -1), ((0, 5), 0),
                                              ((4, 1), 1)])
def test_varlen_gather_combine_matches_reference(tmp_path, counts, skip_rank):
    spawn_ranks(_worker, (counts, skip_rank), tmp_path)
