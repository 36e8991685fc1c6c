"""Tensors of a distributed run against a single-process reference, normwise: ``max|a - b| <=
rtol * max|b|`` for each pair, the worst pair kept (verify's comparison, for the built-in model
and for the user's)."""

from __future__ import annotations

from typing import Any

import torch

RTOL = 1e-5  # the built-in model's: float32 throughout, the same reductions
# by the least precise dtype a model computes in: a sum in another order differs by a few
# units of its last place, summed over a step (float32: ~1e-7 each; bfloat16: ~4e-3)
RTOL_BY_DTYPE = {"float64": 1e-9, "float32": RTOL, "float16": 5e-3, "bfloat16": 2e-2}


def rtol_for(dtypes: set[str]) -> float:
    """The tolerance for a model computing in ``dtypes`` (``torch.bfloat16`` or
    ``bfloat16``): the least precise one's; float32's where none is a float known here."""
    known = [RTOL_BY_DTYPE[d.removeprefix("torch.")] for d in dtypes
             if d.removeprefix("torch.") in RTOL_BY_DTYPE]
    return max(known, default=RTOL)


class Comparison:
    def __init__(self, rtol: float = RTOL) -> None:
        self.rtol = rtol
        self.failures: list[str] = []
        self.compared = 0
        self._worst: dict[str, Any] = {"rel": 0.0, "abs": 0.0, "tol": 0.0, "what": None}

    def check(self, what: str, got: torch.Tensor | None, want: torch.Tensor | None) -> None:
        """One pair; None is a gradient never made (a parameter no token reached): zeros."""
        if got is None and want is None:
            self.compared += 1
            return
        got_t = got if got is not None else torch.zeros_like(want)  # type: ignore[arg-type]
        want_t = want if want is not None else torch.zeros_like(got_t)
        if got_t.shape != want_t.shape:
            self.failures.append(f"{what}: shape {list(got_t.shape)} != "
                                 f"{list(want_t.shape)}")
            return
        self.compared += 1
        if got_t.numel() == 0:
            return
        abs_err = float((got_t.double() - want_t.double()).abs().max())
        scale = float(want_t.double().abs().max())
        tol = self.rtol * scale + 1e-12
        rel = abs_err / scale if scale > 0 else (0.0 if abs_err == 0 else float("inf"))
        if rel > self._worst["rel"] or self._worst["what"] is None:
            self._worst.update(rel=rel, abs=abs_err, tol=tol, what=what)
        if abs_err > tol:
            self.failures.append(f"{what}: max abs err {abs_err:.3g} > tolerance {tol:.3g}")

    def fail(self, why: str) -> None:
        self.failures.append(why)

    def report(self, steps: int, what: str) -> dict[str, Any]:
        """reference.json (analysis.runs.ReferenceReport reads it)."""
        w = self._worst
        return {"ok": not self.failures and self.compared > 0, "max_abs_err": w["abs"],
                "max_rel_err": w["rel"], "tolerance": w["tol"], "rtol": self.rtol,
                "worst": w["what"], "compared": self.compared,
                "failures": self.failures[:20], "steps": steps, "what": what}
