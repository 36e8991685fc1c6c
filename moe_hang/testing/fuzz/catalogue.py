"""The fault kinds a generated job can carry: what each plants, where, and in which run modes it
can be seen. What a kind means for the verdict, the culprit and the lines is in
:mod:`.truth`; how it is written into the job, in :mod:`.render`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

# where a kind is planted: on a site (a statement that posts collectives) or at a point
# before one (the culprit stops, blocks or is slow there)
Target = Literal["site", "point"]
# what a site must allow for the kind to be planted on it
Needs = Literal["skip", "extra", "size", "dtype", "alt", "swap_next", "group_var", "send",
                "none"]


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
)

BY_NAME = {k.name: k for k in KINDS}


def kind(name: str) -> Kind:
    if name not in BY_NAME:
        raise ValueError(f"unknown fault kind {name!r}; known: {', '.join(BY_NAME)}")
    return BY_NAME[name]
