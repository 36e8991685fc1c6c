"""gloo's rules where the simulator needs more than "same op and bytes complete", each
measured on torch 2.13 CPU (gloo's tcp transport) and read off gloo's algorithms:

- a broadcast is a binomial tree (gloo/broadcast.cc; virtual rank 0 the root): a rank gets
  the data from its parent, then leaves once every child posted its receive;
- an all-reduce is a ring (gloo/allreduce.cc): each rank splits its buffer into ``2 * W``
  segments of ``roundUp(ceil(bytes / 2W), element size)`` bytes, posts recvs from the next
  rank and sends to the previous one, a reduce-scatter then an all-gather, two in flight; a
  send goes only once its peer posted the matching recv (gloo/transport/tcp/pair.cc, first in
  first out per slot), and a recv shorter than what arrives aborts the process
  (``op.preamble.length <= op.nbytes``: 1 vs 161 floats, "164 vs 4"), a longer one takes it.
  :func:`ring` plays that out: where the segments are equal (1 vs 4 floats; 4 vs 6 on 3+
  ranks) nothing aborts, some ranks complete it and go on, and the others wait in it;
- an all-gather with other bytes aborts (a rank receives a longer chunk than its own);
- different ops use different slots and wait for ever, except all_reduce against
  reduce_scatter, which aborts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from moe_hang.testing.fuzz.events import tag_bytes

# pairs of different ops that gloo aborts on (the rest wait for ever)
ABORTING_OPS = frozenset({frozenset({"all_reduce", "reduce_scatter"})})
# ProcessGroupGloo's worker threads per group (its Options' default: 2, measured): a
# collective posted while two of the group's are stuck for good never runs
WORKERS = 2


@dataclass(frozen=True)
class Meeting:
    """What gloo does when every member of a group posts one op with other bytes at one
    sequence number: it ``abort``s (``sure``: the members that certainly end in it, if they
    are blocked in it, by gloo's abort or by the error their peer's death raises there;
    ``killed``: those gloo may abort, SIGABRT, whose recorder is then never written), or the
    members in ``through`` complete it and the others wait in it for ever."""

    abort: bool
    through: frozenset[int] = frozenset()
    sure: frozenset[int] = frozenset()
    killed: frozenset[int] = frozenset()


def tree(v: int, size: int) -> tuple[int | None, list[int]]:
    """Parent and children of virtual rank ``v`` in gloo's binomial broadcast of ``size``:
    in round i the ranks below 2**i send to their peer with bit i set."""
    dim = max(1, (size - 1).bit_length())
    high = v.bit_length() - 1  # the round v receives in (-1: the root)
    parent = v ^ (1 << high) if v else None
    children = [v | (1 << i) for i in range(high + 1, dim) if (v | (1 << i)) < size]
    return parent, children


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _round_up(a: int, b: int) -> int:
    return _ceil(a, b) * b


def _ring_ops(pos: int, size: int, elem: int, total: int) -> list[tuple[str, str, int]]:
    """What group rank ``pos`` issues in gloo's ring all-reduce of ``total`` bytes (small
    buffers: ``2 * size`` segments, two per rank), in order: ``("recv", buffer, bytes)`` from
    the next rank, ``("send", "out", bytes)`` to the previous one, ``("wait_recv", buffer, 0)``
    and ``("wait_send", "out", 0)`` (each waits for one more completion on that buffer). The
    reduce-scatter receives into a scratch buffer, the all-gather into the output; a segment
    past the end of the buffer is neither sent nor received."""
    segments, per_rank = 2 * size, 2
    seg = _round_up(_ceil(total, segments), elem)
    span = segments * seg
    last = segments - per_rank
    ops: list[tuple[str, str, int]] = []
    for send_base, recv_base, buf in ((pos + 1, pos + 2, "tmp"), (pos, pos + 1, "out")):
        def lengths(i: int, send_base: int = send_base, recv_base: int = recv_base
                    ) -> tuple[int, int]:
            sent = ((send_base * per_rank + i) * seg) % span
            got = ((recv_base * per_rank + i) * seg) % span
            return min(seg, total - sent), min(seg, total - got)

        for i in range(last + 2):
            if i >= 2:
                sent, got = lengths(i - 2)
                if got > 0:
                    ops.append(("wait_recv", buf, 0))
                if sent > 0:
                    ops.append(("wait_send", "out", 0))
            if i < last:
                sent, got = lengths(i)
                if got > 0:
                    ops.append(("recv", buf, got))
                if sent > 0:
                    ops.append(("send", "out", sent))
    return ops


def ring(sizes: Sequence[tuple[int, int]]) -> tuple[frozenset[int], frozenset[int]]:
    """gloo's ring all-reduce where group rank p posts ``sizes[p]`` (element size, elements):
    the group ranks gloo aborts (a matched send longer than their recv), and those whose
    part completes (they go on to their next collective, unless an abort came first)."""
    size = len(sizes)
    progs = [_ring_ops(p, size, elem, elem * n) for p, (elem, n) in enumerate(sizes)]
    pc = [0] * size
    recvs: list[list[tuple[str, int]]] = [[] for _ in range(size)]  # from p + 1
    sends: list[list[int]] = [[] for _ in range(size)]  # to p - 1
    waited = [{"tmp": 0, "out": 0, "send": 0} for _ in range(size)]
    moved = True
    while moved:
        moved = False
        for p in range(size):
            nxt, prv = (p + 1) % size, (p - 1) % size
            while pc[p] < len(progs[p]):
                what, buf, nbytes = progs[p][pc[p]]
                if what == "recv":
                    recvs[p].append((buf, nbytes))
                elif what == "send":
                    sends[p].append(nbytes)
                else:
                    if what == "wait_recv":  # this buffer's recvs a send of p + 1 matched
                        done = sum(b == buf for b, _ in recvs[p][:len(sends[nxt])])
                    else:  # this rank's sends whose recv p - 1 posted
                        done, buf = min(len(sends[p]), len(recvs[prv])), "send"
                    if done <= waited[p][buf]:
                        break
                    waited[p][buf] += 1
                pc[p] += 1
                moved = True
    aborts = frozenset(p for p in range(size) if any(
        sent > got for (_, got), sent in zip(recvs[p], sends[(p + 1) % size], strict=False)))
    return aborts, frozenset(p for p in range(size) if pc[p] == len(progs[p]))


def same_op(op: str, tags: Mapping[int, str], order: tuple[int, ...]) -> Meeting:
    """Every member of ``order`` (the group, in its rank order) posted ``op`` with the tags
    ``tags``, not all equal."""
    sizes = {m: tag_bytes(tags[m]) for m in order}
    known = {m: b for m, b in sizes.items() if b is not None}
    if op == "all_reduce" and len(known) == len(order):
        aborts, done = ring([known[m] for m in order])
        if aborts:  # a rank whose part completed may have gone on before the abort
            return Meeting(True, sure=frozenset(order[p] for p in aborts | (
                frozenset(range(len(order))) - done)),
                killed=frozenset(order[p] for p in aborts))
        return Meeting(False, through=frozenset(order[p] for p in done))
    if op == "all_gather" and len(known) == len(order):
        # the largest may have received all it expects (shorter chunks) and gone on
        top = max(b[0] * b[1] for b in known.values())
        smaller = frozenset(m for m, b in known.items() if b[0] * b[1] < top)
        return Meeting(True, sure=smaller, killed=smaller)
    return Meeting(True, killed=frozenset(order))
