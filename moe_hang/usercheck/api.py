"""``moe_hang.check(build, batch, world=2)``: moe-hang check on the user's own model, from
Python; raises :class:`HangReproduced` (its message: the check's first screen) when a plan
makes it hang. With ``reference=`` (the same model in one process, every expert local) every
clean run is also compared with it, step by step, and :class:`ReferenceMismatch` is raised
where they differ: verify's proof, on the user's code. The ranks import ``build``, ``batch``
and ``reference`` by name, so each must be a module-level function of an importable module (a
test file is one)."""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from moe_hang.analysis.plans import CheckResult
from moe_hang.errors import MoeHangError
from moe_hang.probe.layout import RunLayout
from moe_hang.probe.routing import ENV_ROUTER
from moe_hang.runtime import launcher, rundir
from moe_hang.runtime.procs import starting_child
from moe_hang.runtime.reference import finish_reference, reference_report, start_reference
from moe_hang.settings import Settings


class HangReproduced(AssertionError):
    """A plan made the model hang (or desync, or crash): the message is the diagnosis. An
    AssertionError, so a test that calls ``moe_hang.check`` fails with it."""

    def __init__(self, message: str, result: CheckResult):
        super().__init__(message)
        self.result = result


class ReferenceMismatch(AssertionError):
    """Every plan ran clean, but some run's outputs, losses or gradients differ from the
    single-process reference's: the fix changed the model's math. The message says where."""

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


def check(build: Callable[[], Any], batch: Callable[[int, int], Any], *,
          reference: Callable[[], Any] | None = None, world: int = 2, steps: int = 3,
          plans: int = 8, rtol: float | None = None, reduce: str = "mean", stall_s: float = 5.0,
          timeout_s: float = 300.0, router: type | str | None = None,
          out: str | os.PathLike[str] | None = None,
          say: Callable[[str], None] = lambda _: None,
          settings: Settings | None = None) -> CheckResult:
    """Run ``build``'s model for ``steps`` steps on ``world`` gloo ranks (torchrun) under
    every routing plan of moe-hang check; the result, or :class:`HangReproduced`.

    ``reference``: builds the same model in one process (every expert local; ``build`` itself
    often does, on the one-rank group the reference process has). Each clean run's outputs,
    losses and whole gradients are then compared with it at every step (``max|a - b| <= rtol *
    max|b|``; by default ``rtol`` is the least precise dtype's the model computes in: 1e-5 for
    float32, 5e-3 float16, 2e-2 bfloat16), under the same plan; :class:`ReferenceMismatch`
    where they differ. ``reduce``:
    how the ranks' gradients combine, ``"mean"`` (DDP, FSDP) or ``"sum"`` (expert parallel
    with no data-parallel averaging). ``router``: the class of your router (or
    ``"pkg.mod.Class"``) where the blocks have no ``experts`` child beside a
    ``gate``/``router``. ``settings``: the tool's own waits (default: as the CLI reads them,
    ``MOE_HANG_<FIELD>`` overrides from the environment)."""
    from moe_hang.commands.check import check_command
    from moe_hang.report.check import check_screen

    timings = settings if settings is not None else Settings.from_env(os.environ)
    if world < 2:
        raise MoeHangError(f"world={world}: a hang needs at least 2 ranks")
    if reduce not in ("mean", "sum"):
        raise MoeHangError(f"reduce={reduce!r}: give 'mean' or 'sum'")
    if rtol is not None and not rtol > 0:
        raise MoeHangError(f"rtol={rtol}: must be positive")
    b, root = _ref(build, "build")
    x, root2 = _ref(batch, "batch")
    ref, root3 = _ref(reference, "reference") if reference is not None else (None, root)
    torchrun = shutil.which("torchrun", path=os.pathsep.join(
        [str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    if torchrun is None:
        raise MoeHangError("torchrun not found beside this Python or on PATH")
    cmd = [torchrun, "--nproc-per-node", str(world), "--standalone", "-m",
           "moe_hang.usercheck.rank", "--build", b, "--batch", x, "--steps", str(steps),
           *(["--save"] if ref is not None else [])]
    if isinstance(router, type):
        router = f"{router.__module__}.{router.__qualname__}"
    if router is not None and ("." not in router or "<locals>" in router):
        raise MoeHangError(f"router={router!r}: give a class of an importable module")
    paths = [str(root), str(root2), str(root3), os.environ.get("PYTHONPATH", "")]
    saved = {k: os.environ.get(k) for k in ("PYTHONPATH", ENV_ROUTER)}
    os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(p for p in paths if p))
    if router is not None:
        os.environ[ENV_ROUTER] = router  # the ranks inherit it
    try:
        res = check_command(cmd, say, settings=timings, out=None if out is None else str(out),
                            stall_s=stall_s, timeout_s=timeout_s, max_plans=plans,
                            command=["moe_hang.check", b, x])
        if ref is not None and not res.reproduced:
            say("comparing with the single-process reference")
            _compare(res, ["--reference", ref, "--batch", x, "--world", str(world),
                           "--steps", str(steps), "--reduce", reduce,
                           *(["--rtol", str(rtol)] if rtol is not None else []),
                           *(["--router", router] if router is not None else [])], timeout_s)
    finally:
        for key, value in saved.items():  # the caller's environment as it was
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    text = "\n".join(line.plain for line in check_screen(res, 100))
    if res.reproduced:
        raise HangReproduced(text, res)
    if res.differs:
        raise ReferenceMismatch(text, res)
    return res


def _compare(res: CheckResult, args: list[str], timeout_s: float) -> None:
    """The single-process reference over every clean run (one process, bounded, ended
    whatever happens); each run's comparison on its :class:`PlanResult`."""
    runs = [r for r in res.runs if r.verdict == "healthy"]
    spec = [{"run_dir": r.run_dir, "plan": None if r.plan is None else r.plan.to_dict()}
            for r in runs]
    log_path = RunLayout(res.run_dir).reference_log
    proc = None
    try:
        with starting_child():
            proc = start_reference([*args, "--runs", json.dumps(spec)], log_path,
                                   launcher.job_env())
        finish_reference(proc, log_path, timeout_s)
    finally:  # an interrupt between the two: it is ended all the same
        if proc is not None and proc.poll() is None:
            finish_reference(proc, log_path, timeout_s, compare=False)
    for r in runs:
        r.reference = reference_report(RunLayout(Path(r.run_dir)).reference, log_path)
    res.compared = True
    rundir.write_json(res.run_dir / "check.json", res.to_dict())
