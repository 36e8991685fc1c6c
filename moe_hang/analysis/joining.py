"""Ranks stuck making a process group (``init_process_group``, ``new_group``, a device
mesh): no collective of theirs is in question — the group never formed, so no collective
could be posted on it. Every rank of a group must call its creation, with the same world
size and rendezvous, and be able to reach the others' addresses. Pure."""

from __future__ import annotations

from moe_hang.analysis.advice import Advice
from moe_hang.analysis.conclusion import Conclusion
from moe_hang.analysis.diagnosis import Certainty, CulpritBasis, Verdict
from moe_hang.analysis.explain import site_str
from moe_hang.analysis.facts import Facts, stuck_shown
from moe_hang.analysis.failures import restarted
from moe_hang.evidence.stacks import Frame, is_library_frame
from moe_hang.evidence.vocab import agree, who

# torch's functions that make a group: a rank inside one waits on the store or its peers
_MAKERS = ("init_process_group", "new_group", "new_subgroups", "init_device_mesh",
           "_new_process_group_helper")


def _makers(frames: list[Frame]) -> list[str]:
    """The torch functions making a group that this stack (innermost first) is inside."""
    return [f.function for f in frames if f.function in _MAKERS
            and "torch/distributed/" in f.file.replace("\\", "/")]


def making_group(frames: list[Frame]) -> str | None:
    """The innermost torch function making a group that this stack is inside."""
    return next(iter(_makers(frames)), None)


def all_joining(f: Facts) -> bool:
    """Every live rank's main thread is inside a group's creation."""
    return bool(f.alive) and all(making_group(f.views[r].stack.frames) is not None
                                 for r in f.alive)


def stuck_joining(f: Facts) -> Conclusion:
    ranks = sorted(f.alive)  # all of them: the rule holds only where all_joining does
    views = [f.views[r] for r in ranks]
    # the outermost torch function making it (init_process_group, not its helper)
    made = {_makers(v.stack.frames)[-1] for v in views}
    what = made.pop() if len(made) == 1 else "a process group's creation"
    sites = {user for v in views if (user := _user_line(v.stack.frames)) is not None}
    at = f" at {site_str(sites.pop())}" if len(sites) == 1 else ""
    summary = (f"All {len(ranks)} ranks are inside {what}{at} and none has finished it: the "
               "group never formed (the ranks meet through the store, then connect to each "
               f"other), so no collective was posted on it. {who(ranks).capitalize()} "
               f"{agree(ranks, 'waits', 'wait')} there for a rank that does not come or "
               "cannot be reached.")
    # uncertain always: ranks waiting for a peer still loading (another node's start) look
    # just the same, and watch must not end a job that is only slow to form; a hang only
    # where the stall is shown
    first = ""
    if f.ev.restarts is not None:  # a restarted attempt: the first one's failure is the cause
        summary += f" torchrun restarted the ranks: {restarted(f.ev.restarts)[0]}."
        first = ("torchrun restarted these ranks: what failed the first attempt is what to "
                 "fix (its log; or run it with --max-restarts 0 under `moe-hang watch`, which "
                 "diagnoses that failure). ")
    stuck = stuck_shown(f)
    if not stuck:
        summary += " Nothing here shows whether it is stuck or only slow to form."
    return Conclusion(
        Verdict.HANG if stuck else Verdict.INCONCLUSIVE, [], CulpritBasis.NONE,
        Certainty.UNCERTAIN, summary,
        Advice(first + "Every rank of the group must call it, with the same world size and "
               "rendezvous (MASTER_ADDR, MASTER_PORT; a rank started late or not at all "
               "holds the others), and reach the others' addresses (GLOO_SOCKET_IFNAME or "
               "NCCL_SOCKET_IFNAME on a host with several interfaces; a firewall). "
               "TORCH_CPP_LOG_LEVEL=INFO shows each rank's connection attempts."))


def _user_line(frames: list[Frame]) -> Frame | None:
    """The job's own line that called it (innermost user frame outside moe-hang's probe)."""
    return next((x for x in frames if not is_library_frame(x)
                 and "/moe_hang/" not in x.file.replace("\\", "/")), None)
