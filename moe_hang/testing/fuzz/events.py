"""What one rank does in a generated job, as records the simulator steps through: collectives
on a named group (waited at once, or posted with ``async_op=True`` and waited later), point-to-
point transfers, a background thread's own program (started, then joined), and the ways a rank
stops (it raises, exits, is killed, or blocks outside every collective)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

# the group a collective is posted on: "world" (the default group; a 1-D device mesh over
# every rank is the default group too), "log" (a second group of every rank), "thread" (the
# metrics thread's own group of every rank), "dp" / "tp" (a 2-D mesh's dimensions)
GroupKey = str
# an op that stands for a stretch of framework collectives whose exact order is not modelled
# (FSDP's or DTensor's backward): two ranks both in it match; anything else against it breaks
# the job there (gloo aborts or hangs, which of the two is not modelled)
OPAQUE = "opaque"
StopHow = Literal["raise", "exit", "kill", "block"]
_TAG = re.compile(r"^f(32|64)x(\d+)$")


@dataclass(frozen=True)
class Coll:
    """A collective: ``tag`` stands for its sizes and dtype (equal tags: the same bytes,
e.g. ``f32x4``); every barrier's tag is ``barrier``. ``nowait``: posted with
``async_op=True`` (the rank goes on; a :class:`Wait` waits for it); ``thread``: posted by the
rank's background thread of that name (fed by a queue), not by its main thread."""

    group: GroupKey
    op: str
    tag: str
    marker: str
    ident: str = ""  # which module's all-gather (not part of what gloo matches)
    nowait: bool = False
    thread: str = ""


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


@dataclass(frozen=True)
class Wait:
    """``work.wait()`` on every collective this thread posted with ``nowait`` since its last
    wait (the step's end)."""

    marker: str


@dataclass(frozen=True)
class Fork:
    """A background thread starts with this program (a metrics thread: what it will be fed)."""

    thread: str
    events: tuple[Coll, ...]


@dataclass(frozen=True)
class Join:
    """``thread.join()``: until the thread's program is done."""

    thread: str
    marker: str


Event = Coll | P2P | Stop | Wait | Fork | Join


def tag_bytes(tag: str) -> tuple[int, int] | None:
    """(element size, number of elements) of a tag written ``f32x<n>`` / ``f64x<n>``; None
    for a tag that only names a shape (a module's all-gather, a barrier)."""
    m = _TAG.match(tag)
    return (int(m.group(1)) // 8, int(m.group(2))) if m else None
