"""Injected by ``moe-hang watch`` through PYTHONPATH: install the probe in every rank.

It loads ``moe_hang/probe/probe.py`` by path (stdlib only), so the job may run in any Python
environment, with or without moe-hang installed. It acts only in processes that have ``RANK``
set (torchrun's workers), never in the agent or in a rank's own children, and then hands over
to whatever ``sitecustomize`` the job would have imported without us.
"""

import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))


def _install_probe() -> None:
    if not os.environ.get("RANK") or not os.environ.get("MOE_HANG_PROBE_DIR"):
        return
    path = os.path.join(os.path.dirname(_HERE), "probe.py")  # moe_hang/probe/probe.py
    try:
        spec = importlib.util.spec_from_file_location("moe_hang_probe", path)
        if spec is None or spec.loader is None:
            return
        mod = importlib.util.module_from_spec(spec)
        sys.modules["moe_hang_probe"] = mod
        spec.loader.exec_module(mod)
        mod.install()
    except Exception as exc:  # never break the user's job
        sys.stderr.write(f"[moe-hang] probe not installed: {exc}\n")


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
