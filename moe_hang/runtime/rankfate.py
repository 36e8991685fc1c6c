"""How a rank left or stands, from its probe's files: what it raised, whether its interpreter
shut down cleanly, how many ranks its node runs."""

from __future__ import annotations

import json
from pathlib import Path

from moe_hang.evidence.probe_records import Heartbeat
from moe_hang.evidence.vocab import who
from moe_hang.probe.layout import RankFiles


def raised_by(probe_dir: Path, ranks: list[int]) -> tuple[str, int | None]:
    """"rank 2 raised ValueError: corrupt shard 17" (its probe's record), and when."""
    try:
        err = json.loads(RankFiles(probe_dir, ranks[0]).error.read_text())
        what = f"{err['type']}: {str(err.get('message', ''))[:100]}".rstrip(": ")
        t = err.get("time")
        when = int(float(t) * 1e9) if isinstance(t, (int, float)) else None
    except (OSError, ValueError, KeyError, TypeError):
        what, when = "an exception", None
    more = f" (and {who(ranks[1:])})" if len(ranks) > 1 else ""
    return f"rank {ranks[0]} raised {what}{more}", when


def _attempt_of(path: Path) -> int | None:
    """The restart count an error record was written in (None: not said)."""
    try:
        v = json.loads(path.read_text()).get("restart")
    except (OSError, ValueError, AttributeError):
        return None
    return v if isinstance(v, int) else None


def left_cleanly(files: RankFiles, hb: Heartbeat | None) -> bool:
    """The rank's interpreter shut down normally: the probe's last beat says ``exiting`` and it
    left no exception and no fatal-signal dump (an abort or SIGKILL never says ``exiting``);
    an exception of an earlier attempt (torchrun restarted the workers) is not its own."""
    if hb is None or not hb.said_exiting:
        return False
    if files.error.exists() and not (
            hb.restart and (a := _attempt_of(files.error)) is not None and a < hb.restart):
        return False
    try:
        return files.fatal.stat().st_size == 0
    except OSError:
        return True


def local_world_from(hbs: dict[int, Heartbeat]) -> int | None:
    """How many ranks this node should see (LOCAL_WORLD_SIZE; WORLD_SIZE on one node)."""
    for hb in hbs.values():
        n = hb.local_world or hb.world
        if n:
            return n
    return None
