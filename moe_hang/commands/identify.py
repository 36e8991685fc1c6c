"""``diagnose``: the ranks neither a probe nor a launcher variable named, named from their own
frames (``py-spy dump --locals``: the DDP tutorial's ``main(rank, world_size)``, a script's
``rank = ...``, ``init_process_group``'s own arguments while inside it).

A number two processes claim, or one an identified rank already has, names neither: such a
process stays unidentified (keyed ``-pid``, named by its PID in every report) rather than
get a number the tool would have guessed.
"""

from __future__ import annotations

from moe_hang.capture import pyspy
from moe_hang.commands.session import Phase
from moe_hang.evidence.rankid import identity_from_locals
from moe_hang.runtime.discover import FoundJob, RankProc, rank_order


def from_frames(job: FoundJob, say: Phase, *, timeout: float) -> None:
    """Name what can be named of ``job.unidentified()`` from their frames, in place (py-spy
    bounded by ``timeout``: ``Settings.pyspy_timeout_s``)."""
    unknown = job.unidentified()
    if not unknown or pyspy.find_pyspy() is None:
        return
    say(f"reading the frames of {len(unknown)} rank(s) with no rank in their environment")
    stacks = pyspy.pyspy_many({r.rank: r.pid for r in unknown}, timeout=timeout,
                              with_locals=True)
    taken = {r.rank for r in job.ranks if r.identified}
    claims: dict[int, list[tuple[RankProc, int | None]]] = {}
    for r in unknown:
        data = stacks[r.rank].data
        rank, world = identity_from_locals(data, r.pid) if data is not None else (None, None)
        if rank is not None and rank not in taken:
            claims.setdefault(rank, []).append((r, world))
    for rank, procs in claims.items():
        if len(procs) == 1:
            r, world = procs[0]
            r.rank, r.identity, r.world_size = rank, "frames", r.world_size or world
    job.ranks.sort(key=rank_order)
    if job.world_size is None:
        job.world_size = next((r.world_size for r in job.ranks if r.world_size), None)
