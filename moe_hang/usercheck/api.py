"""``moe_hang.check(build, batch, world=2)``: moe-hang check on the user's own model, from
Python; raises :class:`HangReproduced` (its message: the check's first screen) when a plan
makes it hang. The ranks import ``build`` and ``batch`` by name, so both must be module-level
functions of an importable module (a test file is one)."""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from moe_hang.analysis.plans import CheckResult
from moe_hang.errors import MoeHangError
from moe_hang.probe.routing import ENV_ROUTER


class HangReproduced(AssertionError):
    """A plan made the model hang (or desync, or crash): the message is the diagnosis. An
    AssertionError, so a test that calls ``moe_hang.check`` fails with it."""

    def __init__(self, message: str, result: CheckResult):
        super().__init__(message)
        self.result = result


def _ref(fn: Callable[..., Any], what: str) -> tuple[str, Path]:
    """``module:qualname`` and the sys.path entry the ranks need to import it."""
    mod, name = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    module = sys.modules.get(mod or "")
    path = getattr(module, "__file__", None)
    if not mod or mod == "__main__" or "<locals>" in name or path is None:
        raise MoeHangError(f"{what}: give a module-level function of an importable module "
                           f"(got {mod}:{name}); the ranks import it by name")
    # the directory above the top package: one level per dot, one more for a package itself
    root = Path(path).resolve().parent
    for _ in range(mod.count(".") + (Path(path).name == "__init__.py")):
        root = root.parent
    return f"{mod}:{name}", root


def check(build: Callable[[], Any], batch: Callable[[int, int], Any], *, world: int = 2,
          steps: int = 3, plans: int = 8, stall_s: float = 5.0, timeout_s: float = 300.0,
          router: type | str | None = None, out: str | os.PathLike[str] | None = None,
          say: Callable[[str], None] = lambda _: None) -> CheckResult:
    """Run ``build``'s model for ``steps`` steps on ``world`` gloo ranks (torchrun) under
    every routing plan of moe-hang check; the result, or :class:`HangReproduced`.
    ``router``: the class of your router (or ``"pkg.mod.Class"``) where the blocks have no
    ``experts`` child beside a ``gate``/``router``."""
    from moe_hang.commands.check import check_command
    from moe_hang.report.check import check_screen

    if world < 2:
        raise MoeHangError(f"world={world}: a hang needs at least 2 ranks")
    b, root = _ref(build, "build")
    x, root2 = _ref(batch, "batch")
    torchrun = shutil.which("torchrun", path=os.pathsep.join(
        [str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    if torchrun is None:
        raise MoeHangError("torchrun not found beside this Python or on PATH")
    cmd = [torchrun, "--nproc-per-node", str(world), "--standalone", "-m",
           "moe_hang.usercheck.rank", "--build", b, "--batch", x, "--steps", str(steps)]
    if isinstance(router, type):
        router = f"{router.__module__}.{router.__qualname__}"
    if router is not None and ("." not in router or "<locals>" in router):
        raise MoeHangError(f"router={router!r}: give a class of an importable module")
    paths = [str(root), str(root2), os.environ.get("PYTHONPATH", "")]
    saved = {k: os.environ.get(k) for k in ("PYTHONPATH", ENV_ROUTER)}
    os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(p for p in paths if p))
    if router is not None:
        os.environ[ENV_ROUTER] = router  # the ranks inherit it
    try:
        res = check_command(cmd, say, out=None if out is None else str(out), stall_s=stall_s,
                            timeout_s=timeout_s, max_plans=plans,
                            command=["moe_hang.check", b, x])
    finally:
        for key, value in saved.items():  # the caller's environment as it was
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    if res.reproduced:
        text = "\n".join(line.plain for line in check_screen(res, 100))
        raise HangReproduced(text, res)
    return res
