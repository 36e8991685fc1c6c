"""The source facts a capture stores (``source.json``): read where the job's files are, when
the capture is made; the analysis asks only them, so a capture gives the same verdict on any
machine, with or without the job's files."""

from __future__ import annotations

import builtins
import json
import shutil
from pathlib import Path

import pytest

from moe_hang.analysis.rules import diagnose
from moe_hang.analysis.source import Order, enclosing_loop, order, rank_condition
from moe_hang.capture.source import read_facts
from moe_hang.evidence.load import load_capture
from moe_hang.evidence.source import SourceFacts
from moe_hang.evidence.stacks import Frame

JOB = """\
import torch.distributed as dist

for step in range(8):
    dist.all_reduce(x)  # AR
    if rank == 0:
        evaluate()  # EVAL
    for expert in experts:
        y = expert(x)  # EXPERT
"""


def _line(text: str, needle: str) -> int:
    return next(i for i, ln in enumerate(text.splitlines(), 1) if needle in ln)


def test_facts_read_at_capture_travel_as_json(tmp_path: Path) -> None:
    job = tmp_path / "train.py"
    job.write_text(JOB)
    lines = {k: _line(JOB, f"# {k}") for k in ("AR", "EVAL", "EXPERT")}
    src = read_facts(Frame(str(job), n, "<module>") for n in lines.values())
    back = SourceFacts.from_dict(json.loads(json.dumps(src.to_dict())))
    assert back == src
    assert rank_condition(back, str(job), lines["EVAL"]) == "if rank == 0"
    assert enclosing_loop(back, str(job), lines["EXPERT"]) == "for expert in experts"
    assert order(back, str(job), lines["AR"], lines["EVAL"]) is Order.A_FIRST
    # torch's own frames and unreadable files are not read
    none = read_facts([Frame("/x/site-packages/torch/distributed/distributed_c10d.py", 5, "f"),
                       Frame(str(tmp_path / "gone.py"), 3, "g")])
    assert none.files == {}
    assert SourceFacts.from_dict({"files": {"a.py": {"x": 1, "3": {"path": "bad"}}}}) \
        == SourceFacts({"a.py": {}})


@pytest.mark.parametrize("name", ["fsdp2_eval_stale_0", "subgroup_skip_3", "mesh6_stacks_0",
                                  "extra_eval_stacks_2"])
def test_the_analysis_opens_no_source_file(fixtures: Path, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """Stored facts alone: the verdict of a capture whose job files are gone is the one it
    had where they were, and the analysis never opens a ``.py`` file."""
    run = tmp_path / "run"
    shutil.copytree(fixtures / name, run)
    ev = load_capture(run)
    assert ev.source is not None and ev.source.files
    expected = diagnose(load_capture(run)).to_dict()
    real_open = builtins.open

    def guarded(file, *a, **kw):  # type: ignore[no-untyped-def]
        if str(file).endswith(".py"):
            raise AssertionError(f"the analysis opened {file}")
        return real_open(file, *a, **kw)

    monkeypatch.setattr(builtins, "open", guarded)
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **kw: (_ for _ in ()).throw(
        AssertionError(f"the analysis read {self}")) if str(self).endswith(".py")
        else Path.read_bytes(self).decode())
    got = diagnose(ev).to_dict()
    assert {k: got[k] for k in ("verdict", "culprit_ranks", "summary", "fix")} == \
        {k: expected[k] for k in ("verdict", "culprit_ranks", "summary", "fix")}


GROUPS = """\
import torch.distributed as dist

LOG = dist.new_group([0, 1])
SUB = dist.new_group([0])
SUB = dist.new_group([1])


def step(tp):
    dist.barrier(group=LOG)  # LOG1
    dist.all_reduce(x, group=LOG)  # LOG2
    dist.all_reduce(x, group=SUB)  # TWICE
    dist.all_reduce(x, group=tp)  # LOCAL
    dist.all_reduce(x)  # DEFAULT
"""


def test_a_group_the_module_names_once_is_one_group_on_every_line(tmp_path: Path) -> None:
    """``group=LOG`` on two lines is one group where the module assigns LOG once at its top
    level; a name assigned twice, or a function's own, says nothing of which group."""
    job = tmp_path / "train.py"
    job.write_text(GROUPS)
    lines = {k: _line(GROUPS, f"# {k}") for k in ("LOG1", "LOG2", "TWICE", "LOCAL", "DEFAULT")}
    src = read_facts(Frame(str(job), n, "step") for n in lines.values())
    back = SourceFacts.from_dict(json.loads(json.dumps(src.to_dict())))
    got = {k: (lf.group, lf.default_group) for k, n in lines.items()
           if (lf := back.line(str(job), n)) is not None}
    assert got == {"LOG1": ("LOG", False), "LOG2": ("LOG", False), "TWICE": (None, False),
                   "LOCAL": (None, False), "DEFAULT": (None, True)}


EVERY = """\
import torch.distributed as dist

RANK, WORLD = dist.get_rank(), dist.get_world_size()
ALL = dist.new_group(list(range(WORLD)))
NONE_GIVEN = dist.new_group(backend="gloo")
PAIR = dist.new_group([0, 1])
FIRST = dist.new_group(list(range(WORLD - 1)))


def step(tp):
    dist.all_reduce(x, group=ALL)  # ALL
    dist.all_reduce(x, group=NONE_GIVEN)  # NONE_GIVEN
    dist.all_reduce(x, group=PAIR)  # PAIR
    dist.all_reduce(x, group=FIRST)  # FIRST
    dist.all_reduce(x, group=tp)  # LOCAL
    dist.all_reduce(x)  # DEFAULT
"""


def test_a_group_of_every_rank_is_known_as_such(tmp_path: Path) -> None:
    """``new_group()`` with no ranks, or ``list(range(WORLD))`` of the world size, spans every
    rank; a list of ranks, a shorter range or a group the function is handed does not say so
    (False where the call passes another group: what counting ranks across camps needs)."""
    job = tmp_path / "train.py"
    job.write_text(EVERY)
    names = ("ALL", "NONE_GIVEN", "PAIR", "FIRST", "LOCAL", "DEFAULT")
    lines = {k: _line(EVERY, f"# {k}") for k in names}
    src = read_facts(Frame(str(job), n, "step") for n in lines.values())
    back = SourceFacts.from_dict(json.loads(json.dumps(src.to_dict())))
    got = {k: lf.every_rank for k, n in lines.items()
           if (lf := back.line(str(job), n)) is not None}
    assert got == {"ALL": True, "NONE_GIVEN": True, "PAIR": False, "FIRST": False,
                   "LOCAL": False, "DEFAULT": True}


GUARDS = """\
import torch.distributed as dist

def report(rank, bad, steps, q):
    while (step := q.get()) is not None:
        if rank == bad and step == 3:
            continue
        if step > 100:
            continue
        dist.all_reduce(x, group=g)  # GUARDED
    if rank == 0:
        pass
    else:
        dist.barrier()  # ELSE
    dist.barrier()  # AFTER
"""


def test_a_guard_that_leaves_the_loop_on_a_rank_condition_is_the_lines_condition(
        tmp_path: Path) -> None:
    """``if rank == bad and step == 3: continue`` before a collective in the same loop body:
    the collective runs under ``not (...)``; a guard on something else, or an ``if`` with an
    ``else``, is none; a line after the loop is not under the loop's guards."""
    job = tmp_path / "metrics.py"
    job.write_text(GUARDS)
    lines = {k: _line(GUARDS, f"# {k}") for k in ("GUARDED", "ELSE", "AFTER")}
    src = read_facts(Frame(str(job), n, "report") for n in lines.values())
    got = {k: rank_condition(src, str(job), n) for k, n in lines.items()}
    assert got == {"GUARDED": "if not (rank == bad and step == 3)",
                   "ELSE": "if not (rank == 0)", "AFTER": None}
