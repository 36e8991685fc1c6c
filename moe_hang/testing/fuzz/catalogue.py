"""The fault kinds a generated job can carry: what each plants, where, in which step layouts
(:mod:`.shapes`) and in which run modes it can be seen. What a kind means for the verdict,
the culprit and the lines is in :mod:`.truth`; how it is written into the job, in
:mod:`.render`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

# where a kind is planted: on a site (a statement that posts collectives) or at a point
# before one (the culprit stops, blocks or is slow there)
Target = Literal["site", "point"]
# what a site must allow for the kind to be planted on it
Needs = Literal["skip", "extra", "size", "dtype", "alt", "swap_next", "group_var", "send",
                "none", "twin", "last", "nowait", "thread", "units"]


@dataclass(frozen=True)
class Kind:
    name: str
    what: str
    target: Target
    needs: Needs
    healthy: bool = False  # the job is slow, not stuck: it must be let finish
    # diagnose attaches to a job that is stuck for good (or slow for long): the kinds whose
    # culprit ends its process, and gloo's aborts, leave nothing to attach to
    attachable: bool = True
    shapes: tuple[str, ...] = ("plain",)  # the step layouts it is planted in


KINDS: tuple[Kind, ...] = (
    Kind("skip", "the culprit skips a collective the others post (a step it thinks it may "
         "skip, a module or an expert it does not call)", "site", "skip"),
    Kind("extra", "the culprit posts a collective the others do not (a rank-only "
         "evaluation, checkpoint or logging call)", "site", "extra"),
    Kind("size", "the culprit posts a collective with a different number of elements",
         "site", "size", attachable=False),
    Kind("dtype", "the culprit posts a collective in a different dtype", "site", "dtype",
         attachable=False),
    Kind("op_swap", "the culprit posts a different collective where the others post this "
         "one", "site", "alt"),
    Kind("order_swap", "the culprit posts two collectives of different groups in the other "
         "order", "site", "swap_next"),
    Kind("wrong_group", "the culprits pass the wrong mesh dimension's group", "site",
         "group_var"),
    Kind("recv_no_send", "the culprit skips a send: its peer waits in a recv nobody matches",
         "site", "send"),
    Kind("exception", "the culprit raises", "point", "none", attachable=False),
    Kind("early_exit", "the culprit leaves the job early, cleanly (exit code 0)", "point",
         "none", attachable=False),
    Kind("sigkill", "the culprit is SIGKILLed (as the OOM killer does)", "point", "none",
         attachable=False),
    Kind("lock", "the culprit's main thread deadlocks on two locks with a background thread, "
         "outside every collective", "point", "none"),
    Kind("sleep", "healthy: the culprit sleeps a few seconds (a slow checkpoint write), "
         "shorter than --hang-after", "point", "none", healthy=True, attachable=False),
    Kind("busy", "healthy: the culprit computes a few seconds longer than the others (a "
         "straggler)", "point", "none", healthy=True),
    # the shapes gloo pairs silently (issue 27): collectives of one op and size posted from
    # different lines, by the k-th of a group, whichever line or thread posted it
    Kind("silent", "the culprit skips, or adds, a collective with the op and bytes of the "
         "next one it posts (a size-1 accuracy all-reduce before the size-1 loss one): gloo "
         "pairs them silently, and the job breaks collectives later (a size abort, another "
         "op, or the final barrier)", "site", "twin", shapes=("loss", "ntok")),
    Kind("step_shift", "the culprit skips, or adds, the last collective of a step (the loss "
         "all-reduce after backward): the next step's first collective, at an earlier line, "
         "pairs with the others' last", "site", "last", shapes=("loss", "ntok")),
    Kind("fsdp_eval", "under FSDP2 the culprit alone evaluates, or gathers a full "
         "checkpoint, between two steps: its all-gathers of the units pair silently with the "
         "others' next forward, which go on into their backward, where gloo aborts or hangs",
         "site", "units", attachable=False),
    Kind("async", "the culprit skips, or adds, a collective posted with async_op=True and "
         "waited at the step's end, several in flight", "site", "nowait", shapes=("async",)),
    Kind("thread", "the culprit's metrics thread skips, or adds, an all-reduce on a group of "
         "its own (fed by a queue each step); the main thread goes on and joins it after the "
         "loop", "site", "thread", shapes=("thread",)),
)
# the new kinds whose plant is a skip or an extra of one site (variant "skip" / "extra")
SHIFTS = ("silent", "step_shift", "async", "thread")

BY_NAME = {k.name: k for k in KINDS}


def kind(name: str) -> Kind:
    if name not in BY_NAME:
        raise ValueError(f"unknown fault kind {name!r}; known: {', '.join(BY_NAME)}")
    return BY_NAME[name]
