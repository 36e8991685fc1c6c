"""What RAS's collective counts are, and the words every sentence built from them uses — pure.

A count is NCCL's ``comm->seqNumber[func]``, bumped when a collective's kernel plan is
*launched* (``ncclProfilerStartTaskEvents``), before it runs: a rank that launched the 101st
all-reduce may still wait in it, and one that launched ten more may be stuck in the first of
them. Only the five collectives of :data:`COUNTED_OPS` are counted — no send/recv, so no
all-to-all either (torch builds it from grouped send/recv: an MoE dispatch is invisible here) —
and collectives captured in a CUDA graph are left out. A sentence from counts therefore says
"launched", never "completed", and carries :data:`LAUNCH_COUNTS_CAVEAT`
(:func:`with_launch_caveat`).
"""

from __future__ import annotations

LAUNCH_COUNTS_CAVEAT = ("RAS counts launches of Broadcast, Reduce, AllGather, ReduceScatter "
                        "and AllReduce, not completions, and no send/recv or all-to-all")


def with_launch_caveat(sentence: str) -> str:
    """``sentence`` with the caveat every count-based sentence must carry."""
    body = sentence.rstrip()
    if body.endswith("."):
        body = body[:-1]
    return f"{body} ({LAUNCH_COUNTS_CAVEAT})."


def ordinal(n: int) -> str:
    """1st, 2nd, 3rd, 11th, 101st."""
    if 10 <= n % 100 <= 20:
        return f"{n}th"
    return f"{n}{ {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th') }"


def launched(op: str, count: int) -> str:
    """``launched AllReduce 101 times`` / ``launched AllReduce once`` / ``launched no ...``."""
    if count == 0:
        return f"launched no {op}"
    return f"launched {op} " + ("once" if count == 1 else f"{count} times")


