"""The probe's last word on endings Python never sees: gloo's ``std::terminate`` and
``os._exit`` (stdlib only; it runs in every rank).

gloo aborts a rank from its I/O thread: an exception ("Received data size doesn't match
expected size") escapes the thread, the C++ runtime calls the terminate handler, which prints
"terminate called after throwing ..." and aborts. :func:`hook_terminate` puts a handler of
ours in front of it (through ctypes: ``std::set_terminate`` of the libstdc++ torch uses) that
runs the probe's last gasp, then the previous handler, so the message and the SIGABRT (and
faulthandler's stack in ``fatal.txt``) happen as before. :func:`wrap_os_exit` does the same for
``os._exit``. Either hook is skipped, whole, when anything about it fails: then the rank ends
exactly as it would without us.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

_SET_TERMINATE = "_ZSt13set_terminatePFvvE"  # std::set_terminate(void (*)())
# a last gasp that has not returned by then (an import or a lock that never comes back) must
# not keep a dying rank alive: faulthandler's watchdog, a C thread, ends it (exit code 1)
WATCHDOG_S = 20.0


class _Terminate:
    """The installed handler: the ctypes objects must live as long as the process."""

    def __init__(self) -> None:
        self.proto: Any = None
        self.call: Any = None  # the previous handler's prototype for calling it, GIL held
        self.callback: Any = None
        self.previous: int | None = None
        self.set_terminate: Any = None
        self.on = False
        self.tried = False  # once a process: a failed attempt is not retried every tick


_HOOK = _Terminate()


def hook_terminate(last_gasp: Callable[[str], None]) -> bool:
    """Run ``last_gasp("abort")`` first when the C++ runtime terminates this process (once;
    only in the process that hooked it, not a forked child). True when installed."""
    if _HOOK.tried:
        return _HOOK.on
    _HOOK.tried = True
    try:
        import ctypes  # here: a rank that never imports torch never loads it

        lib = ctypes.CDLL("libstdc++.so.6")  # already loaded by torch: the same instance
        set_terminate = getattr(lib, _SET_TERMINATE)
    except (OSError, AttributeError):
        return False
    set_terminate.restype = ctypes.c_void_p
    set_terminate.argtypes = [ctypes.c_void_p]
    proto = ctypes.CFUNCTYPE(None)
    pid = os.getpid()

    def on_terminate() -> None:
        # ctypes took the GIL for us; everything here is bounded, and nothing may raise
        if os.getpid() == pid and _HOOK.on:
            with contextlib.suppress(Exception):
                faulthandler.dump_traceback_later(WATCHDOG_S, exit=True, file=2)
            with contextlib.suppress(BaseException):
                last_gasp("abort")
            with contextlib.suppress(Exception):
                faulthandler.cancel_dump_traceback_later()
        _call_previous()

    callback = proto(on_terminate)
    try:
        previous = set_terminate(ctypes.cast(callback, ctypes.c_void_p))
    except Exception:
        return False
    # called with the GIL held (PYFUNCTYPE): released, the job's other Python threads would
    # run while faulthandler walks their frames on SIGABRT (a segfault, not the abort)
    _HOOK.proto, _HOOK.callback, _HOOK.previous = proto, callback, previous
    _HOOK.call = ctypes.PYFUNCTYPE(None)
    _HOOK.set_terminate, _HOOK.on = set_terminate, True
    return True


def _call_previous() -> None:
    """The handler that was there before ours (libstdc++'s verbose one: the message, then
    abort); abort() if there was none."""
    if _HOOK.previous:
        _HOOK.call(_HOOK.previous)()
    os.abort()


def unhook_terminate() -> None:
    """Put the previous handler back: at interpreter exit, before C++ static destructors run
    in a process whose Python is gone (a callback into it then would crash)."""
    if not _HOOK.on:
        return
    _HOOK.on = False
    with contextlib.suppress(Exception):
        _HOOK.set_terminate(_HOOK.previous)


def wrap_os_exit(last_gasp: Callable[[str], None]) -> None:
    """``os._exit`` runs ``last_gasp("os_exit")`` first, in this process only (a forked
    DataLoader worker leaves through ``os._exit`` too, and is no rank)."""
    real = os._exit
    if getattr(real, "_moe_hang_real", None) is not None:
        return
    pid = os.getpid()

    def _exit(*args: Any, **kwargs: Any) -> Any:
        if os.getpid() == pid:
            with contextlib.suppress(BaseException):
                last_gasp("os_exit")
        return real(*args, **kwargs)

    _exit._moe_hang_real = real  # type: ignore[attr-defined]
    _exit.__doc__ = real.__doc__
    os._exit = _exit


# ------------------------------------------------------------------ SIGTERM and exit


def at_exit(fn: Callable[[], Any]) -> None:
    # threading's own exit hooks run before atexit, module teardown and C++ destructors
    (getattr(threading, "_register_atexit", None) or __import__("atexit").register)(fn)


def _unblock_sigterm() -> None:
    with contextlib.suppress(Exception):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})


class SigtermRelay:
    """SIGTERM (torchrun, mp.spawn or srun tearing the job down) goes to one thread of ours,
    which has the probe write its dump and then lets the signal take its usual effect.

    SIGTERM is blocked in the main thread before any thread of torch's exists (at startup for
    torchrun's workers; right before ``init_process_group`` creates its threads otherwise), so
    they inherit the mask and only this thread receives it, even while the main thread is stuck
    in C++ inside a collective. A thread that existed before (an OpenMP pool started by an
    earlier matmul) does not block it: if the kernel picks that one, the rank ends as it would
    without us, only without the dump."""

    started = False
    on_sigterm: Callable[[], None] | None = None

    @classmethod
    def start(cls, on_sigterm: Callable[[], None]) -> None:
        cls.on_sigterm = on_sigterm
        if cls.started or threading.current_thread() is not threading.main_thread():
            return
        cls.started = True
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        os.register_at_fork(after_in_child=_unblock_sigterm)
        with contextlib.suppress(Exception):
            at_exit(_unblock_sigterm)  # before interpreter shutdown freezes the relay thread
        threading.Thread(target=cls._loop, name="moe-hang-sigterm", daemon=True).start()

    @staticmethod
    def _loop() -> None:
        while True:
            signal.sigwait({signal.SIGTERM})
            if SigtermRelay.on_sigterm is not None:
                SigtermRelay.on_sigterm()
            # Let the signal take its normal effect: unblock it in this thread only and resend.
            # With the default disposition the process ends as its launcher expects (-15); with
            # a Python handler installed by the job, Python runs it in the main thread as usual.
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
