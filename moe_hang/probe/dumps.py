"""What the probe writes of its rank on request (:class:`Dumps`, a part of
:class:`~moe_hang.probe.probe.Probe`), from its own thread while the main thread may be blocked
inside a collective: the Flight Recorder (its counts per group, its pickle, with call-site
frames where they are cheap), the process groups' members, every thread's stack, and a marker
naming the request — answered on the rank's control FIFO (``rank{R}.ctl``). Stdlib only."""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import select
import sys
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

if __package__ == "moe_hang.probe":
    from moe_hang.probe import sample
    from moe_hang.probe.env import ENV_FR_STACKS, write_atomic
    from moe_hang.probe.layout import RankFiles
else:  # loaded by path (watch's sitecustomize): probe.py loaded its siblings first
    sample = sys.modules["moe_hang_probe_sample"]
    _env = sys.modules["moe_hang_probe_env"]
    ENV_FR_STACKS, write_atomic = _env.ENV_FR_STACKS, _env.write_atomic
    RankFiles = sys.modules["moe_hang_probe_layout"].RankFiles  # type: ignore[misc]


class Dumps:
    """The dump half of the probe; :class:`~moe_hang.probe.probe.Probe` holds the rest (and
    the methods this part calls back)."""

    rank: int
    interval: float
    files: RankFiles
    routing: Any
    _main_ident: int | None
    _requested: bool
    _release: threading.Event
    _calling_torch: Callable[..., AbstractContextManager[Any]]
    heartbeat: Callable[[], None]

    def _fr_status(self) -> dict[str, Any] | None:
        with self._calling_torch() as torch:
            return self._read_status(torch)

    @staticmethod
    def _read_status(torch: Any) -> dict[str, Any] | None:
        """The recorder's counts per group (the caller holds the torch lock)."""
        if torch is None:
            return None
        try:
            raw = torch._C._distributed_c10d._dump_fr_trace_json(includeCollectives=False)
            status = json.loads(raw).get("pg_status", {})
        except Exception:
            return None
        return {pg: {"enqueued": int(s.get("last_enqueued_collective", -1)),
                     "completed": int(s.get("last_completed_collective", -1)),
                     # -1 without start events (TORCH_NCCL_ENABLE_TIMING=1 gives them)
                     "started": int(s.get("last_started_collective", -1))}
                for pg, s in status.items()}

    def _want_stacks(self) -> bool:
        """Call-site frames in recorder dumps, when they are cheap.

        torch symbolizes them through torch._dynamo: the first dump of a process that has not
        imported it yet imports ~800 modules (about 2 s of CPU). Jobs that use DTensor, FSDP2
        or torch.compile have it already; elsewhere stacks come from py-spy or faulthandler,
        unless MOE_HANG_FR_STACKS=1 asks for them anyway."""
        forced = os.environ.get(ENV_FR_STACKS)
        if forced is not None:
            return forced not in ("", "0")
        # whole, not only begun: a module is in sys.modules from the start of its import (a
        # second or so for this one), and symbolizing then imports torch._inductor from our
        # thread while the job's imports it too; Python's deadlock avoidance hands one of
        # them a half-made module, an ImportError in the job (watch on ragged_dtensor.py)
        mod = sys.modules.get("torch._dynamo")
        return mod is not None and not getattr(getattr(mod, "__spec__", None),
                                               "_initializing", False)

    def _stacks_at_capture(self) -> bool:
        """At a capture, frames also where they are not cheap, while the import machinery
        is quiet (:func:`sample.quiet_for_imports`): a capture is what the verdict is read
        from, and the frames of every collective it holds are the history's lines."""
        if self._want_stacks():
            return True
        if os.environ.get(ENV_FR_STACKS) is not None:
            return False  # MOE_HANG_FR_STACKS=0: never
        return sample.quiet_for_imports(self._main_ident)

    def _fr_pickle(self, stacks: bool | None = None) -> bytes | None:
        with self._calling_torch() as torch:
            if torch is None:
                return None
            try:
                return bytes(torch._C._distributed_c10d._dump_fr_trace(
                    includeStackTraces=self._want_stacks() if stacks is None else stacks))
            except Exception:
                return None

    def _pending_entries(self, status: dict[str, Any]) -> list[dict[str, Any]]:
        raw = self._fr_pickle()
        return [] if raw is None else sample.pending_entries(raw, status)

    def _groups(self) -> dict[str, list[int]] | None:
        """Process group name -> global member ranks (subgroups, device-mesh dimensions)."""
        with self._calling_torch() as torch:
            if torch is None:
                return None
            try:
                world = torch.distributed.distributed_c10d._world
                return {str(pg.group_name): sorted(int(r) for r in ranks)
                        for pg, ranks in world.pg_group_ranks.items()}
            except Exception:
                return None

    def dump(self, request: str, reason: str) -> None:
        """Flight Recorder pickle + all-thread stacks, then a marker naming the request."""
        files = []
        if self.routing is not None:  # a GPU's counts whose copy is done
            with contextlib.suppress(Exception):
                self.routing.drain()
        raw = self._fr_pickle(stacks=self._stacks_at_capture())
        if raw is not None:
            write_atomic(self.files.fr, raw)
            files.append(self.files.fr.name)
        groups = self._groups()
        if groups:
            write_atomic(self.files.groups, json.dumps(groups).encode())
            files.append(self.files.groups.name)
        tmp = self.files.stack.with_name(self.files.stack.name + ".tmp")
        with open(tmp, "w") as f:
            faulthandler.dump_traceback(file=f, all_threads=True)
        os.replace(tmp, self.files.stack)
        files.append(self.files.stack.name)
        marker = {"request": request, "reason": reason, "time": time.time(), "pid": os.getpid(),
                  "rank": self.rank, "files": files}
        write_atomic(self.files.dump_marker, json.dumps(marker).encode())

    def _open_fifo(self) -> tuple[int, int] | None:
        fifo = self.files.ctl
        try:
            with contextlib.suppress(FileNotFoundError):
                fifo.unlink()
            os.mkfifo(fifo, 0o600)
            rfd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
            # Hold a writer ourselves so the read end never sees EOF between requests.
            wfd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        except OSError:
            return None
        return rfd, wfd

    def _loop(self, fds: tuple[int, int] | None) -> None:
        buf = b""
        while True:
            try:
                if fds is not None:
                    ready, _, _ = select.select([fds[0]], [], [], self.interval)
                    if ready:
                        buf += os.read(fds[0], 4096)
                        while b"\n" in buf:
                            line, buf = buf.split(b"\n", 1)
                            words = line.decode(errors="replace").split()
                            if words and words[0] == "dump":
                                self._requested = True
                                self.dump(words[1] if len(words) > 1 else "", "request")
                            elif words and words[0] == "release":
                                self._release.set()
                else:
                    time.sleep(self.interval)
                self.heartbeat()
            except Exception:  # the probe must never take the rank down
                time.sleep(self.interval)
