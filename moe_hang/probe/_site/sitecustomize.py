"""Injected by ``moe-hang watch`` through PYTHONPATH: install the probe in every rank.

It loads ``moe_hang/probe/probe.py`` by path (stdlib only), so the job may run in any Python
environment, with or without moe-hang installed, and then hands over to whatever
``sitecustomize`` the job would have imported without us.

A rank is a process that joins a process group. torchrun's workers say so at startup
(``RANK``): the probe starts at once, before the job can create a group, so the recorder and
the SIGTERM routing are in place from the first collective. Every other process (mp.spawn's
ranks, ``srun``/``mpirun`` tasks, a script that computes its rank, but also the launchers,
data-loader and compile workers) gets only a hook on ``init_process_group``: a finder on
``sys.meta_path`` that waits for ``torch.distributed.distributed_c10d`` to be imported, wraps
that one function as soon as the module has executed — before ``torch.distributed``'s
``from .distributed_c10d import *`` and ``device_mesh``'s import copy it, so
``init_device_mesh`` and ``DeviceMesh`` go through it too — and removes itself. The wrapper
passes the call through untouched and, once it has returned, starts the probe with the rank
and world size of the default group. A process that never calls it sees no thread, no file
and no torch import from us: one string comparison per import until torch.distributed loads.
A rank's own children never start a probe (``MOE_HANG_PROBE_OWNER``, see probe.install).
A torchrun worker gets the hook too: right after its ``init_process_group`` the probe starts
counting the MoE routers' tokens (probe/routing.py), before the model's first call.
"""

import functools
import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
_C10D = "torch.distributed.distributed_c10d"
_MARK = "_moe_hang_wrapped"


def _load_probe():
    mod = sys.modules.get("moe_hang_probe")
    if mod is not None:
        return mod
    path = os.path.join(os.path.dirname(_HERE), "probe.py")  # moe_hang/probe/probe.py
    spec = importlib.util.spec_from_file_location("moe_hang_probe", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["moe_hang_probe"] = mod
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        del sys.modules["moe_hang_probe"]
        raise
    return mod


def _say(what, exc):
    sys.stderr.write(f"[moe-hang] probe not installed ({what}): {exc}\n")


def _wrap(real):
    """``init_process_group`` as the job calls it: its arguments, return value and
    exceptions untouched; the probe around it, and nothing of ours can make it fail."""

    @functools.wraps(real)
    def init_process_group(*args, **kwargs):
        probe = None
        try:
            mod = _load_probe()
            if mod.before_join():
                probe = mod
        except Exception as exc:  # never break the user's job
            _say("before init_process_group", exc)
        result = real(*args, **kwargs)
        try:
            if probe is not None:
                probe.after_join()
            mod = sys.modules.get("moe_hang_probe")
            if mod is not None:
                mod.joined()  # a torchrun worker's probe started before: its routers now
        except Exception as exc:
            _say("after init_process_group", exc)
        return result

    setattr(init_process_group, _MARK, True)
    return init_process_group


def _patch(module):
    real = getattr(module, "init_process_group", None)
    if callable(real) and not getattr(real, _MARK, False):
        module.init_process_group = _wrap(real)


class _C10dFinder:
    """Finds nothing itself: for torch.distributed.distributed_c10d only, it asks the finders
    behind it for the real spec and has that module's loader patch the module once it has
    executed. One-shot: it leaves sys.meta_path at the first sight of the module."""

    def find_spec(self, name, path=None, target=None):
        if name != _C10D:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        for finder in list(sys.meta_path):
            find = getattr(finder, "find_spec", None)
            spec = find(name, path, target) if find is not None else None
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        run = getattr(loader, "exec_module", None)
        if run is None:
            return spec

        def exec_module(module):
            run(module)
            try:
                _patch(module)
            except Exception as exc:
                _say("patching init_process_group", exc)

        # this module's own loader instance only: its type, name and source stay the same
        loader.exec_module = exec_module
        return spec


def _install_probe() -> None:
    if not os.environ.get("MOE_HANG_PROBE_DIR"):
        return
    if os.environ.get("RANK"):  # torchrun's worker (or a rank's child: install says no)
        try:
            if _load_probe().install() is None:
                return
        except Exception as exc:
            _say("at startup", exc)
            return
    if _C10D in sys.modules:  # cannot happen at startup; a re-run of this file, say
        _patch(sys.modules[_C10D])
    elif not any(isinstance(f, _C10dFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _C10dFinder())


def _chain() -> None:
    """Run the sitecustomize we shadow, if the job has one further along sys.path."""
    for entry in sys.path:
        if not entry or os.path.abspath(entry) == _HERE:
            continue
        candidate = os.path.join(entry, "sitecustomize.py")
        if os.path.isfile(candidate):
            spec = importlib.util.spec_from_file_location("_moe_hang_chained_sitecustomize",
                                                          candidate)
            if spec is not None and spec.loader is not None:
                mod = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(mod)
            return


_install_probe()
_chain()
