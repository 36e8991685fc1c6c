"""What each command adds to a diagnosis (docs/DESIGN.md §5): repro/verify's
:class:`ScenarioRun` (with verify's :class:`ReferenceReport`), watch's :class:`WatchRun`,
diagnose's :class:`AttachRun`, and the :class:`Timings` they measure. Pure."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Timings:
    """Seconds, measured by the command (docs/DESIGN.md §5)."""

    wall_s: float | None = None
    startup_s: float | None = None
    capture_s: float | None = None
    onset_to_verdict_s: float | None = None
    onset_to_detect_s: float | None = None

    def to_dict(self) -> dict[str, float]:
        return {k: v for k, v in (("capture_s", self.capture_s), ("wall_s", self.wall_s),
                                  ("startup_s", self.startup_s),
                                  ("onset_to_verdict_s", self.onset_to_verdict_s),
                                  ("onset_to_detect_s", self.onset_to_detect_s))
                if v is not None}


@dataclass
class ReferenceReport:
    """verify --fixed: the comparison with the single-process reference (reference.json)."""

    ok: bool
    max_abs_err: float = 0.0
    max_rel_err: float = 0.0
    tolerance: float = 0.0
    rtol: float = 0.0
    worst: str | None = None
    compared: int = 0
    failures: list[str] = field(default_factory=list)
    steps: int = 0
    what: str = ""
    error: str | None = None  # the reference itself could not run: nothing was compared

    @classmethod
    def parse(cls, d: dict[str, Any]) -> ReferenceReport:
        return cls(ok=bool(d.get("ok")), max_abs_err=float(d.get("max_abs_err", 0.0)),
                   max_rel_err=float(d.get("max_rel_err", 0.0)),
                   tolerance=float(d.get("tolerance", 0.0)), rtol=float(d.get("rtol", 0.0)),
                   worst=d.get("worst"), compared=int(d.get("compared", 0)),
                   failures=[str(f) for f in d.get("failures") or []],
                   steps=int(d.get("steps", 0)), what=str(d.get("what", "")),
                   error=None if d.get("error") is None else str(d["error"]))

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "max_abs_err": self.max_abs_err, "max_rel_err": self.max_rel_err,
                "tolerance": self.tolerance, "rtol": self.rtol, "worst": self.worst,
                "compared": self.compared, "failures": self.failures, "steps": self.steps,
                "what": self.what, "error": self.error}


@dataclass
class ScenarioRun:
    """What repro and verify add to a diagnosis (docs/DESIGN.md §5). ``fix`` is the fix's
    name here; its sentence is ``fix_hint``."""

    scenario: str
    variant: str  # broken | fixed
    fix: str
    recommended_fix: str
    fix_hint: str
    backend: str
    nproc: int
    tokens: list[int]
    timings: Timings = field(default_factory=Timings)
    reference: ReferenceReport | None = None
    uncovered_trainable: list[str] | None = None
    reproduced: bool | None = None
    verified: bool | None = None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "scenario": self.scenario, "variant": self.variant, "fix": self.fix,
            "recommended_fix": self.recommended_fix, "fix_hint": self.fix_hint,
            "backend": self.backend, "nproc": self.nproc, "tokens": self.tokens,
            "timings": self.timings.to_dict()}
        if self.reference is not None:
            d["reference"] = self.reference.to_dict()
        if self.uncovered_trainable is not None:
            d["uncovered_trainable"] = self.uncovered_trainable
        if self.reproduced is not None:
            d["reproduced"] = self.reproduced
        if self.verified is not None:
            d["verified"] = self.verified
        return d


@dataclass
class WatchRun:
    """What watch adds: the job's command line, its own exit code, what was detected."""

    command: list[str]
    job_exit_code: int | None
    detected: str
    timings: Timings = field(default_factory=Timings)

    def to_dict(self) -> dict[str, Any]:
        return {"command": self.command, "job_exit_code": self.job_exit_code,
                "detected": self.detected, "timings": self.timings.to_dict()}


@dataclass
class AttachRun:
    """What diagnose adds: the PID it was given and the launcher it found."""

    target_pid: int
    agent_pid: int | None
    timings: Timings = field(default_factory=Timings)

    def to_dict(self) -> dict[str, Any]:
        return {"target_pid": self.target_pid, "agent_pid": self.agent_pid,
                "timings": self.timings.to_dict()}


RunInfo = ScenarioRun | WatchRun | AttachRun
