"""Python stacks of ranks: parse py-spy JSON, faulthandler text and probe samples; tell what a
thread is doing (pure: no torch, no rich, no processes).

Frames are stored innermost first, as py-spy and the Flight Recorder give them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from moe_hang.evidence.calls import P2PCall, RootedCall, pyspy_p2p, pyspy_root
from moe_hang.evidence.ops import C10D_OPS, HELPER_OPS, WAIT_FUNCS
from moe_hang.evidence.vocab import RankState


@dataclass(frozen=True)
class Frame:
    file: str
    line: int
    function: str

    def short(self) -> str:
        return f"{short_path(self.file)}:{self.line} {self.function}"

    def as_dict(self) -> dict[str, Any]:
        return {"file": self.file, "line": self.line, "function": self.function}

    @classmethod
    def from_dict(cls, d: Any) -> Frame | None:
        """:meth:`as_dict` read back; None for anything that is not one."""
        if not isinstance(d, dict):
            return None
        try:
            return cls(str(d["file"]), int(d.get("line") or 0), str(d.get("function", "?")))
        except (KeyError, TypeError, ValueError):
            return None


@dataclass
class ThreadStack:
    name: str
    frames: list[Frame]  # innermost first
    thread_id: str = ""
    active: bool | None = None  # py-spy: on CPU; None when the source cannot tell
    is_main: bool = False
    p2p: P2PCall | None = None  # the point-to-point call it is inside, with its peer
    root: RootedCall | None = None  # the rooted collective it is inside, with its root
    # py-spy --locals: a frame's integer loop counters (``step``: 3), which iteration of the
    # job's own loops it is in (capture/pyspy.py keeps only these)
    counters: dict[Frame, dict[str, int]] = field(default_factory=dict)


@dataclass
class Helper:
    """One of a rank's own child processes (a DataLoader worker, a compile worker) as the
    capture saw it: its main thread's stack, and whether it kept a core busy."""

    pid: int
    name: str  # the process name (never its command line: arguments may hold secrets)
    threads: list[ThreadStack]
    busy: bool | None = None  # on CPU in its sample (py-spy's "active")

    @property
    def kind(self) -> str:
        """What it is, as far as its stack tells."""
        main = main_thread(self.threads)
        if main is not None and any(f.file.replace("\\", "/").endswith(
                "torch/utils/data/_utils/worker.py") for f in main.frames):
            return "DataLoader worker"
        return "child process"

    @property
    def site(self) -> Frame | None:
        """The job's own line it is at (its innermost frame outside libraries)."""
        main = main_thread(self.threads)
        return callsite(main.frames) if main is not None else None


@dataclass
class StackView:
    """What one rank's main thread is doing, as far as its stack tells."""

    state: RankState  # in_collective | computing | idle | unknown (never exited)
    op: str | None = None  # collective op when in_collective
    api: str | None = None  # the torch function the rank waits in (all_gather_single, ...)
    in_backward: bool = False
    autograd_function: str | None = None  # user autograd.Function whose backward is running
    callsite: Frame | None = None
    frames: list[Frame] = field(default_factory=list)
    p2p: P2PCall | None = None
    root: RootedCall | None = None  # a broadcast's src, a reduce's dst, where visible
    thread: str | None = None  # not the main thread's: the thread that is in the collective
    thread_id: str | None = None  # the id of the thread it is (where the source gave one)
    # it waits on its collective at another line than the one that posted it (work.wait())
    waited_at: Frame | None = None
    counters: dict[Frame, dict[str, int]] = field(default_factory=dict)  # as ThreadStack's


def short_path(path: str) -> str:
    for marker in ("site-packages/", "dist-packages/"):
        if marker in path:
            return path.split(marker, 1)[1]
    return path


# ----------------------------------------------------------------------------- parsing


def parse_pyspy(data: Any) -> list[ThreadStack]:
    """``py-spy dump --json`` output: a list of threads with frames innermost first."""
    if isinstance(data, dict):  # some versions wrap threads in an object
        data = data.get("threads", [])
    if not isinstance(data, list):
        raise ValueError("py-spy JSON: expected a list of threads")
    threads = []
    for t in data:
        raw = [f for f in t.get("frames", []) if isinstance(f, dict)]
        frames = [Frame(str(f.get("filename", "?")), int(f.get("line", 0) or 0),
                        str(f.get("name", "?"))) for f in raw]
        name = str(t.get("thread_name") or "")
        is_main = name == "MainThread" or t.get("os_thread_id") == t.get("pid")
        threads.append(ThreadStack(name=name, frames=frames, thread_id=str(t.get("thread_id", "")),
                                   active=t.get("active"), is_main=bool(is_main),
                                   p2p=pyspy_p2p(raw), root=pyspy_root(raw),
                                   counters=_counters(raw, frames)))
    return threads


def _counters(raw: list[dict[str, Any]], frames: list[Frame]) -> dict[Frame, dict[str, int]]:
    """The integer locals py-spy gave of the job's own frames (the capture keeps only its
    loops' counters there)."""
    out: dict[Frame, dict[str, int]] = {}
    for f, fr in zip(raw, frames, strict=True):
        if is_library_frame(fr) or not f.get("locals"):
            continue
        ints = {str(v.get("name")): int(r) for v in f["locals"] if isinstance(v, dict)
                and (r := str(v.get("repr", ""))).isdigit()}
        if ints:
            out.setdefault(fr, ints)
    return out


_FH_THREAD = re.compile(
    r"^(Current thread|Thread) (0x[0-9a-fA-F]+)(?: \[(.*?)\])? \(most recent call first\):")
_FH_FRAME = re.compile(r'^\s+File "(.*)", line (\d+) in (.*)$')


def parse_faulthandler(text: str) -> list[ThreadStack]:
    """faulthandler's all-threads dump (``dump_traceback`` or a fatal-signal dump)."""
    threads: list[ThreadStack] = []
    current: ThreadStack | None = None
    for line in text.splitlines():
        m = _FH_THREAD.match(line)
        if m:
            current = ThreadStack(name=m.group(3) or "", frames=[], thread_id=m.group(2))
            threads.append(current)
            continue
        m = _FH_FRAME.match(line)
        if m and current is not None:
            current.frames.append(Frame(m.group(1), int(m.group(2)), m.group(3)))
    for t in threads:
        outer = t.frames[-1] if t.frames else None
        t.is_main = t.name == "MainThread" or bool(
            outer and (outer.function == "<module>" or "runpy" in outer.file))
        if t.is_main and not t.name:
            t.name = "MainThread"
    return threads


def parse_probe_frames(frames: Any) -> list[Frame]:
    """The probe's ``main_frame`` sample or Flight Recorder ``frames`` (innermost first)."""
    out = []
    for f in frames or []:
        if isinstance(f, dict):
            out.append(Frame(str(f.get("filename", f.get("file", "?"))), int(f.get("line", 0) or 0),
                             str(f.get("name", f.get("function", "?")))))
        elif isinstance(f, (list, tuple)) and len(f) >= 3:
            out.append(Frame(str(f[0]), int(f[1] or 0), str(f[2])))
    return out


_TB_FRAME = re.compile(r'^\s*File "(.*)", line (\d+), in (.*)$')


def traceback_frames(lines: list[str]) -> list[Frame]:
    """A Python traceback's ``File "...", line N, in f`` lines -> frames, innermost first."""
    frames = []
    for line in lines:
        m = _TB_FRAME.match(line)
        if m:
            frames.append(Frame(m.group(1), int(m.group(2)), m.group(3)))
    return list(reversed(frames))


def main_thread(threads: list[ThreadStack]) -> ThreadStack | None:
    for t in threads:
        if t.is_main:
            return t
    return threads[0] if threads else None


# ----------------------------------------------------------------------------- reading

# Frames that are never "the user's line": torch itself, typing_extensions shims, the
# interpreter's runners and moe-hang's own machinery (its model code *is* user code).
# (moe_hang/probe.py and _probe_site/: where captures of earlier versions put them)
_TOOL_FILES = ("moe_hang/probe/", "moe_hang/probe.py", "moe_hang/_probe_site/")


def is_tool_frame(f: Frame) -> bool:
    """A frame of moe-hang's own probe, inside a rank."""
    return _is_tool_path(f.file.replace("\\", "/"))


def _is_tool_path(p: str) -> bool:
    return "moe_hang/" in p and any(t in p for t in _TOOL_FILES)


def is_library_frame(f: Frame) -> bool:
    # asked of every frame of every recorded entry: one pass of plain string tests
    p = f.file.replace("\\", "/") if "\\" in f.file else f.file
    return ("/torch/" in p or p.startswith(("torch/", "<frozen"))
            or p.endswith(("typing_extensions.py", "/runpy.py", "/threading.py"))
            or _is_tool_path(p))


# Python's own library: .../lib/python3.11/ctypes/__init__.py, not what pip installed beside it
_STDLIB = re.compile(r"/lib/python\d+(?:\.\d+)?t?/(?!(?:site|dist)-packages/)|^Lib/|/Lib/"
                     r"(?!site-packages/)")


def is_stdlib_frame(f: Frame) -> bool:
    """A frame of the interpreter's standard library (``lib/python3.X/...`` outside
    ``site-packages``)."""
    return bool(_STDLIB.search(f.file.replace("\\", "/")))


def callsite(frames: list[Frame]) -> Frame | None:
    """The innermost frame outside torch, typing_extensions and moe-hang's machinery, and
    outside Python's own library where a frame of the job's is below it (``ctypes.string_at``
    called from the job: the job's line; the library frame stays in the stack, above it)."""
    ours = [f for f in frames if not is_library_frame(f)]
    job = next((f for f in ours if not is_stdlib_frame(f)), None)
    # else a library frame, unless the probe called it (its dump's lock in an excepthook)
    return job if job is not None or not ours else None if any(
        is_tool_frame(f) for f in frames[frames.index(ours[0]) + 1:]) else ours[0]




def _is_torch_dist(f: Frame) -> bool:
    p = f.file.replace("\\", "/")
    return "torch/distributed/" in p or p.startswith("distributed/")


def _func(f: Frame) -> str:
    return f.function.rsplit(".", 1)[-1]


def collective_of(frames: list[Frame]) -> tuple[str | None, str | None]:
    """(op, torch api) when the stack is inside a collective, else (None, None)."""
    for f in frames:
        name = _func(f)
        if not _is_torch_dist(f):
            continue
        if f.file.endswith("distributed_c10d.py") and name in C10D_OPS:
            return C10D_OPS[name], name
        if name in HELPER_OPS:
            return HELPER_OPS[name], name
    # waiting on an async collective: the op is named by a caller
    if any(_is_torch_dist(f) and _func(f) in WAIT_FUNCS for f in frames):
        for f in frames:
            if _is_torch_dist(f) and _func(f) in HELPER_OPS:
                return HELPER_OPS[_func(f)], _func(f)
        return "unknown", "wait_tensor"
    return None, None


def in_backward(frames: list[Frame]) -> bool:
    return any(f.file.replace("\\", "/").endswith(("torch/autograd/__init__.py",
                                                   "torch/autograd/graph.py"))
               and f.function in ("backward", "_engine_run_backward", "grad")
               for f in frames)


def idle_in_backward(v: StackView) -> bool:
    """Idle in the autograd engine itself (not in a user ``backward`` nor a collective): the
    main thread waits for the engine, where the gradient hooks post their collectives."""
    return (v.state == RankState.IDLE and v.autograd_function is None
            and in_backward(v.frames[:1]))


def autograd_function(frames: list[Frame]) -> str | None:
    """The user's ``autograd.Function.backward`` running (innermost), e.g. ``_GatherVarlen``."""
    for f in frames:
        if not is_library_frame(f) and _func(f) == "backward":
            qual = f.function
            return qual.rsplit(".", 1)[0] if "." in qual else f"backward ({short_path(f.file)})"
    return None


_IDLE_WAITS = ("sleep", "wait", "select", "poll", "acquire", "join", "_wait_for_tstate_lock",
               "read", "recv", "accept")


def _is_idle_wait(frames: list[Frame]) -> bool:
    return bool(frames) and _func(frames[0]) in _IDLE_WAITS


def view(thread: ThreadStack | None) -> StackView:
    """Classify a rank from its main thread's stack."""
    if thread is None or not thread.frames:
        return StackView(RankState.UNKNOWN)
    frames = thread.frames
    op, api = collective_of(frames)
    back = in_backward(frames)
    site = callsite(frames)
    fn = autograd_function(frames) if back else None
    if op is not None:  # a send/recv's peer is not visible without --locals
        p2p = (thread.p2p or P2PCall(op, None)) if op in ("send", "recv") else None
        return StackView(RankState.IN_COLLECTIVE, op, api, back, fn, site, frames, p2p,
                         thread.root, counters=thread.counters,
                         thread_id=thread.thread_id or None)
    if thread.active is True:
        state = RankState.COMPUTING
    elif thread.active is False or _is_idle_wait(frames):
        state = RankState.IDLE
    else:
        state = RankState.UNKNOWN
    return StackView(state, None, None, back, fn, site, frames, counters=thread.counters,
                     thread_id=thread.thread_id or None)


# a recorder dump names every Python thread by its OS name: not a name that tells them apart
# (the probe's posted log has the Python thread's own: ``MainThread``, ``Thread-1 (log)``)
OS_THREAD_NAMES = frozenset({"python", "python3", "pt_main_thread", ""})


def thread_number(tid: str) -> int | None:
    """A thread id as the recorder (decimal), py-spy (decimal), the probe (decimal) or
    faulthandler (hex) write it: the same pthread id."""
    try:
        return int(tid, 0)
    except ValueError:
        return None


def other_thread(a: str | None, b: str | None) -> bool:
    """Two thread ids that are known and name different threads (unknown: not other)."""
    na, nb = (thread_number(a) if a else None), (thread_number(b) if b else None)
    return na is not None and nb is not None and na != nb
