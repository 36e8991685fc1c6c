"""What one rank does in a generated job, as records the simulator steps through: collectives
on a named group, point-to-point transfers, and the ways a rank stops (it raises, exits, is
killed, or blocks outside every collective)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

# the group a collective is posted on: "world" (the default group; a 1-D device mesh over
# every rank is the default group too), "log" (a second group of every rank), "dp" / "tp"
# (a 2-D mesh's dimensions)
GroupKey = str
# an op that stands for a stretch of framework collectives whose exact order is not modelled
# (FSDP's or DTensor's backward): two ranks both in it match; anything else against it is
# unpredictable and the draw picks another plant
OPAQUE = "opaque"
StopHow = Literal["raise", "exit", "kill", "block"]


@dataclass(frozen=True)
class Coll:
    """A collective: ``tag`` stands for its sizes and dtype (equal tags: the same bytes,
e.g. ``f32x4``); every barrier's tag is ``barrier``."""

    group: GroupKey
    op: str
    tag: str
    marker: str
    ident: str = ""  # which module's all-gather (not part of what gloo matches)


@dataclass(frozen=True)
class P2P:
    op: Literal["send", "recv"]
    peer: int
    tag: str
    marker: str


@dataclass(frozen=True)
class Stop:
    """The rank stops here: ``block`` waits for ever outside every collective (a deadlock on
    a lock); the others end it."""

    how: StopHow
    marker: str | None


Event = Coll | P2P | Stop
