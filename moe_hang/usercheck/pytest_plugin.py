"""The pytest plugin (registered as ``moe_hang`` through the ``pytest11`` entry point): the
``moe_hang_check`` fixture, ``moe_hang.check`` with a run directory of its own under the
test's ``tmp_path`` at each call::

    def test_every_rank_calls_every_expert(moe_hang_check):
        moe_hang_check(build_my_moe, my_batch, world=2, steps=3)   # fails with the diagnosis
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture
def moe_hang_check(tmp_path: Path) -> Callable[..., Any]:
    from moe_hang.usercheck.api import check

    calls = itertools.count(1)

    def run(*args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("out", tmp_path / f"moe-hang-check-{next(calls)}")
        return check(*args, **kwargs)

    return run
