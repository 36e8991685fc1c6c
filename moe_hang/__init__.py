"""moe-hang: find, explain and prove the fix for collective deadlocks in distributed PyTorch.

The public API, for your own code (imported lazily: ``import moe_hang`` does not import torch)::

    from moe_hang import VarlenDispatch, AllToAllDispatch   # EP exchanges that cannot hang
    from moe_hang import anchor_gradients                   # the gradient anchor alone
    from moe_hang import FSDPExperts, uncovered_trainable    # FSDP2 experts done right, and a check
    from moe_hang import load_capture, diagnose, Diagnosis  # a run directory -> a verdict
    from moe_hang import check, HangReproduced              # moe-hang check on your model
    from moe_hang import ReferenceMismatch                  # ... with reference=: its proof
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_PUBLIC = {
    "VarlenDispatch": "moe_hang.scenarios.ep",
    "anchor_gradients": "moe_hang.scenarios.ep",
    "AllToAllDispatch": "moe_hang.scenarios.a2a",
    "FSDPExperts": "moe_hang.scenarios.fsdp",
    "uncovered_trainable": "moe_hang.scenarios.fsdp",
    "diagnose": "moe_hang.analysis.rules",
    "Diagnosis": "moe_hang.analysis.diagnosis",
    "load_capture": "moe_hang.evidence.load",
    "check": "moe_hang.usercheck.api",
    "HangReproduced": "moe_hang.usercheck.api",
    "ReferenceMismatch": "moe_hang.usercheck.api",
}
__all__ = ["__version__", *_PUBLIC]


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'moe_hang' has no attribute {name!r}")
