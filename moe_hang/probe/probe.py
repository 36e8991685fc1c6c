"""The in-rank probe: what each rank does so the tool can see inside it without ptrace.

Installed at the top of every rank (the repro worker calls :func:`install`; ``watch`` injects it
through a ``sitecustomize``). It imports nothing heavy and never imports torch itself; it uses
torch only once the job has imported it. Per rank, in the probe directory (file names:
:mod:`moe_hang.probe.layout`):

``rank{R}.hb.json``    heartbeat, rewritten every ``interval`` s: progress, Flight Recorder
                       ``pg_status``, and (once a collective has been pending for a tick) the
                       pending collectives with their call-site frames.
``rank{R}.ctl``        a FIFO: the parent writes ``dump <id>``; the probe thread answers with
                       ``rank{R}.fr.pkl`` (torch's own Flight Recorder pickle),
                       ``rank{R}.stack.txt`` (faulthandler, all threads), ``rank{R}.groups.json``
                       and ``rank{R}.dump.json`` naming the request.
                       This works while the main thread is blocked inside a collective.
``rank{R}.fatal.txt``  faulthandler's stack on SIGABRT/SIGSEGV (gloo's size-mismatch abort).
``rank{R}.posted.jsonl`` every collective it posted, copied from the recorder on each tick it
                       moved and once more however the rank ends (:mod:`.history`,
                       :mod:`.lastgasp`); ``rank{R}.fr.saved.pkl`` the recorder as last copied.
On SIGTERM (torchrun tearing the job down after another rank failed) the same dump is written
with reason ``sigterm`` before the signal takes its usual effect.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

if __package__ == "moe_hang.probe":
    from moe_hang.probe import appendlog, history, lastgasp, launchers, raised, routing, sample
    from moe_hang.probe.dumps import Dumps
    from moe_hang.probe.env import (
        ENV_DIR,
        ENV_FR_STACKS,
        ENV_INTERVAL,
        ENV_OWNER,
        Identity,
        child_of_a_rank,
        enable_flight_recorder,
        installed_elsewhere,
        pid_exists,
        restart_count,
        write_atomic,
    )
    from moe_hang.probe.layout import RankFiles
else:  # loaded by path into a job's own environment (watch's sitecustomize): the siblings too
    import importlib.util as _ilu

    def _sibling(name: str) -> Any:
        spec = _ilu.spec_from_file_location(f"moe_hang_probe_{name}",
                                            Path(__file__).with_name(f"{name}.py"))
        assert spec is not None and spec.loader is not None
        mod = _ilu.module_from_spec(spec)
        sys.modules[spec.name] = mod  # dataclasses look their module up while defining
        spec.loader.exec_module(mod)
        return mod

    sample = _sibling("sample")
    launchers = _sibling("launchers")
    _env = _sibling("env")  # after launchers: it reads its identity variables
    ENV_DIR, ENV_FR_STACKS, ENV_INTERVAL, ENV_OWNER = (
        _env.ENV_DIR, _env.ENV_FR_STACKS, _env.ENV_INTERVAL, _env.ENV_OWNER)
    Identity = _env.Identity  # type: ignore[misc]
    enable_flight_recorder, restart_count = _env.enable_flight_recorder, _env.restart_count
    child_of_a_rank, pid_exists = _env.child_of_a_rank, _env.pid_exists
    installed_elsewhere = _env.installed_elsewhere
    write_atomic = _env.write_atomic
    history = _sibling("history")
    appendlog = _sibling("appendlog")
    lastgasp = _sibling("lastgasp")
    raised = _sibling("raised")
    routeplan = _sibling("routeplan")  # routing.py's own sibling: loaded before it
    routing = _sibling("routing")
    RankFiles = _sibling("layout").RankFiles  # type: ignore[misc]
    # after sample, env and layout: it reads them
    Dumps = _sibling("dumps").Dumps  # type: ignore[misc]

# how often fr.saved.pkl is rewritten while the recorder moves (_record): at least this far
# apart; every copy is spaced by history.COST_RATIO times what the last one cost (so a job's own
# large ring cannot make the probe expensive: 2000 entries, one copy every ~2.5 s)
SAVE_EVERY_S = 1.0


class Probe(Dumps):
    def __init__(self, directory: Path, rank: int, interval: float,
                 identity: Identity | None = None):
        self.dir, self.rank, self.interval = directory, rank, interval
        self.identity = identity or Identity.from_torchrun_env(rank)
        self.files = RankFiles(directory, rank)
        self.progress: dict[str, Any] = {}
        self._beat = 0
        self._last_status: Any = None
        self._final_status: dict[str, Any] | None = None  # taken once, at interpreter exit
        self._stuck_since_beat: int | None = None
        self._pending: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._fatal_file: Any = None
        self._main_ident = threading.main_thread().ident
        self._requested = False
        self._torch_lock = threading.Lock()
        self._hb_lock = threading.Lock()
        self._stopping = False
        self._held = False
        self._thread_errors: list[dict[str, Any]] = []
        self._release = threading.Event()
        self._saved_status: Any = None  # the recorder's status when it was last saved
        self._saved_at = -1e9
        self.routing: Any = None  # routing.Routing once the job has a process group
        self._routing_tried = False
        self.history = history.History(
            appendlog.PostedLog(self.files.posted), self._calling_torch,
            {"kind": "start", "pid": os.getpid(), "rank": rank, "restart": restart_count(),
             "time": time.time()})

    # -------------------------------------------------------------- files

    def _torch(self) -> Any:
        return sys.modules.get("torch")

    @contextlib.contextmanager
    def _calling_torch(self, timeout: float | None = None) -> Iterator[Any]:
        """torch, or None once the process is shutting down: the interpreter and then C++
        static destructors tear torch down at exit, and a dump running in this thread then
        would abort a rank that had finished cleanly. ``timeout``: None too when the lock is
        not free by then (a dying rank's last gasp never waits long)."""
        if not self._torch_lock.acquire(timeout=-1 if timeout is None else timeout):
            yield None
            return
        try:
            yield None if self._stopping else self._torch()
        finally:
            self._torch_lock.release()

    def last_gasp(self, reason: str) -> None:
        """The rank is ending (``reason``): its posted log completed from the recorder,
        bounded. gloo's abort and ``os._exit`` leave nothing else, so there frames are taken
        whatever they cost (torch's symbolizer import, ~1.3 s of CPU in a job that had not
        imported it); an exception or SIGTERM has the probe's dump beside it (fr.pkl), and
        every rank of every job exits: there, frames only where they are cheap."""
        with contextlib.suppress(Exception):
            self.history.last_gasp(
                reason, stacks=reason in ("abort", "os_exit") or self._want_stacks())

    def stop(self) -> None:
        """First thing at interpreter shutdown: no more calls into torch from our threads, and
        a last heartbeat that says so. What follows (module teardown, a garbage collection of
        everything torch imported) can hold the GIL for seconds and starve our thread; the
        watcher must see a rank on its way out there, not one still waiting in the collective
        of its last beat."""
        self.last_gasp("exit")
        # C++ destructors run after Python is gone: a terminate then must not call into it
        lastgasp.unhook_terminate()
        acquired = self._torch_lock.acquire(timeout=2.0)
        if acquired:
            # the recorder's counts as the program left them (torch is whole until the
            # modules are torn down, and they outlive destroy_process_group): what this rank
            # posted on each group, so that a peer's wait can be told from one it will
            # never answer
            self._final_status = self._read_status(self._torch())
        self._stopping = True
        if acquired:
            self._torch_lock.release()
        with self._lock:
            self.progress["phase"] = "exiting"
        with contextlib.suppress(Exception):
            self.heartbeat()

    def heartbeat(self) -> None:
        # the main thread writes the last beat at shutdown while ours may be mid-beat: one at
        # a time, so an older beat never lands after the final one
        if not self._hb_lock.acquire(timeout=2.0):
            return
        try:
            self._heartbeat()
        finally:
            self._hb_lock.release()

    def _record(self, status: dict[str, Any] | None) -> None:
        """On every tick a group posted something, its new entries into the posted log (what
        a rank gloo aborts, or a SIGKILL, leaves behind: history.py); and every few seconds,
        while its counts move, the same dump as the saved recorder (what the analysis reads of
        a rank with no dump at capture). Frames only where they are cheap (_want_stacks)."""
        if status is None or self._stopping:
            return
        if self._torch() is not None:  # gloo's abort comes from C++: hooked once torch is in
            lastgasp.hook_terminate(self.last_gasp)
            self.start_routing()
        now = time.monotonic()
        save = status != self._saved_status and now - self._saved_at >= max(
            SAVE_EVERY_S, history.COST_RATIO * self.history.cost)
        try:
            raw = self.history.tick(status, self._want_stacks(), force=save)
        except Exception:  # a copy that failed is retried next tick; the beat goes on
            return
        if save and raw is not None:
            write_atomic(self.files.fr_saved, raw)
            self._saved_status, self._saved_at = status, now

    def _heartbeat(self) -> None:
        status = self._final_status if self._stopping else self._fr_status()
        self._record(status)
        self._beat += 1
        pending_somewhere = status is not None and any(
            s["enqueued"] > s["completed"] for s in status.values())
        if status != self._last_status:
            self._last_status, self._stuck_since_beat, self._pending = status, None, []
        elif pending_somewhere and self._stuck_since_beat is None and status is not None:
            # Pending and unchanged for a whole tick: worth a full dump, once per state.
            self._stuck_since_beat = self._beat
            self._pending = self._pending_entries(status)
        with self._lock:
            progress = dict(self.progress)
        hb = {
            "rank": self.rank, "pid": os.getpid(), "host": socket.gethostname(),
            "world": self.identity.world, "local_rank": self.identity.local_rank,
            "local_world": self.identity.local_world,
            "time": time.time(), "beat": self._beat, "cpu_s": round(time.process_time(), 3),
            "progress": progress, "pg_status": status, "pending": self._pending,
            "main_frame": sample.main_frame(self._main_ident),
            "main_thread": str(self._main_ident),  # which thread ``main_frame`` is
            "p2p": sample.p2p_call(self._main_ident),
            "restart": restart_count(), "held": self._held,
        }
        write_atomic(self.files.heartbeat, json.dumps(hb, default=str).encode())

    def start_routing(self) -> None:
        """The MoE routers' token counts (probe/routing.py), once the job has joined a
        process group: its torch is whole then, and its model has not run yet (or has just
        begun: a tick late, its first step's first calls go uncounted)."""
        if self._routing_tried:
            return
        dist = sys.modules.get("torch.distributed")
        if dist is None or not getattr(dist, "is_initialized", lambda: False)():
            return
        self._routing_tried = True
        with contextlib.suppress(Exception):
            self.routing = routing.install(self._torch(), self.rank, self.files.routing,
                                           dict(os.environ))

    # -------------------------------------------------------------- threads

    def record_exception(self, exc: BaseException) -> None:
        """The exception that ends a rank, plus a recorder dump: often the survivors' side of
        a peer's death or abort."""
        # the record first: it is small, and torchrun's SIGTERM may end us during the dump
        raised.record_error(exc, restart_count(),
                            lambda err: write_atomic(self.files.error, json.dumps(err).encode()))
        with contextlib.suppress(Exception):
            self.dump("exception", "exception")
        self.last_gasp("exception")

    def record_thread_exception(self, exc: BaseException, thread: threading.Thread | None
                                ) -> None:
        """An exception that ended one of the job's threads, not the rank: the last few, with
        the thread's name and id (the recorder's thread ids)."""
        err = raised.error_record(exc, restart_count())
        err["thread"] = thread.name if thread is not None else None
        err["thread_id"] = str(thread.ident) if thread is not None and thread.ident else None
        self._thread_errors = [*self._thread_errors, err][-raised.THREAD_ERRORS_KEPT:]
        write_atomic(self.files.thread_errors, json.dumps(self._thread_errors).encode())

    def hold(self) -> None:
        """Where the watcher said so (``ranks/hold.json``: multi-node watch), stay alive after
        the exception was recorded, so that every node captures and prints one verdict before
        this rank's exit makes its peers and its launcher tear the job (and the job's store)
        down. Bounded: until the watcher writes ``release``, ends the job (SIGTERM ends the
        rank as usual), is gone, or ``limit_s`` passed."""
        try:
            order = json.loads(self.files.hold.read_text())
            limit, watcher = float(order["limit_s"]), str(order.get("watcher", ""))
        except (OSError, ValueError, KeyError, TypeError):
            return
        if limit <= 0:
            return
        self._held = True
        with contextlib.suppress(Exception):
            self.heartbeat()
        deadline = time.monotonic() + limit
        while not self._release.wait(0.25) and time.monotonic() < deadline:
            if watcher.isdigit() and not pid_exists(int(watcher)):
                break
        self._held = False

    def start(self) -> None:
        self._fatal_file = open(self.files.fatal, "w")  # noqa: SIM115 - kept open for faulthandler
        faulthandler.enable(file=self._fatal_file, all_threads=True)
        lastgasp.SigtermRelay.start(_on_sigterm)
        raised.chain_excepthook(self.record_exception, self.hold)
        raised.chain_thread_excepthook(self.record_thread_exception)
        with contextlib.suppress(Exception):
            lastgasp.wrap_os_exit(self.last_gasp)
        with contextlib.suppress(Exception):
            self.history.thread_names.follow()
        with contextlib.suppress(Exception):
            lastgasp.at_exit(self.stop)
        # the FIFO before the thread: a rank that raises at once is held (hold()) and
        # answers 'release' only once its FIFO exists
        fds = self._open_fifo()
        threading.Thread(target=self._loop, args=(fds,), name="moe-hang-probe",
                         daemon=True).start()
        self.heartbeat()

    def on_sigterm(self) -> None:
        raised.wait_for_record()  # the rank's own exception record, being written
        if not self._requested:  # a requested dump is already on disk: keep it
            with contextlib.suppress(Exception):
                self.dump("sigterm", "sigterm")
        self.last_gasp("sigterm")


_PROBE: Probe | None = None


def _on_sigterm() -> None:
    if _PROBE is not None:
        _PROBE.on_sigterm()


def install(directory: str | os.PathLike[str] | None = None, rank: int | None = None,
            interval: float | None = None, identity: Identity | None = None) -> Probe | None:
    """Install the probe once per process (either copy of this module's is this one's)."""
    global _PROBE
    if _PROBE is None:
        _PROBE = installed_elsewhere(__name__)
    if _PROBE is not None:
        return _PROBE
    directory = directory or os.environ.get(ENV_DIR)
    if identity is not None:
        rank = identity.rank
    rank_s = os.environ.get("RANK") if rank is None else str(rank)
    if not directory or rank_s is None or child_of_a_rank():
        return None
    os.environ[ENV_OWNER] = str(os.getpid())
    enable_flight_recorder()
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    iv = interval if interval is not None else float(os.environ.get(ENV_INTERVAL, "0.25"))
    probe = Probe(d, int(rank_s), iv, identity)
    probe.start()
    _PROBE = probe
    return probe


# ---------------------------------------------------------------- ranks without RANK


def before_join() -> bool:
    """Called by watch's hook right before the job's own ``init_process_group`` (a process
    with no rank in its environment: mp.spawn, srun, mpirun, a hand-written launcher): the
    recorder on and SIGTERM routed to us *before* the group creates its threads. False: this
    process is no rank of ours (a rank's child, or one already probed)."""
    if _PROBE is not None or installed_elsewhere(__name__) is not None \
            or not os.environ.get(ENV_DIR) or child_of_a_rank():
        return False
    enable_flight_recorder()
    lastgasp.SigtermRelay.start(_on_sigterm)
    return True


def after_join() -> Probe | None:
    """Right after ``init_process_group`` returned: the probe, its rank and world size from the
    default group itself, its place on the node from whichever launcher set one."""
    import torch.distributed as dist  # the job has just imported it

    local_rank, local_world = launchers.local_of(dict(os.environ))
    ident = Identity(int(dist.get_rank()), int(dist.get_world_size()), local_rank, local_world)
    return install(identity=ident)


def joined() -> None:
    """Right after any ``init_process_group`` of a probed rank (watch's hook): the routers
    counted from the model's first call on (the probe either copy of this module started)."""
    p = _PROBE or installed_elsewhere(__name__)
    if p is not None:
        with contextlib.suppress(Exception):
            p.start_routing()


def set_progress(**kv: Any) -> None:
    """Report progress (step k of N, phase) in the heartbeat; a no-op without a probe."""
    p = _PROBE or installed_elsewhere(__name__)
    if p is not None:
        with p._lock:
            p.progress.update(kv)
