"""The house rules that keep the tree readable, checked on the source (docs/DESIGN.md §6): the
import graph has no cycle, even through imports inside functions; nothing imports upward;
detection never imports the sentence builders; verdicts are made in the analysis' rules only;
no module of analysis/ or evidence/ keeps state between calls; no module or script past 400
lines."""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "moe_hang"


def _modules() -> dict[str, Path]:
    out = {}
    for p in sorted(PKG.rglob("*.py")):
        rel = p.relative_to(ROOT).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


MODULES = _modules()


def _type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _imports(path: Path) -> set[str]:
    """Every moe_hang module ``path`` imports, at module level or inside a function (not
    under ``if TYPE_CHECKING``)."""
    tree = ast.parse(path.read_text())
    skip: set[int] = set()
    for node in ast.walk(tree):
        if _type_checking(node):
            skip.update(id(n) for n in ast.walk(node))
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        found.update(n for n in names if n in MODULES)
    return found


GRAPH = {m: _imports(p) - {m} for m, p in MODULES.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    seen: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(m: str) -> None:
        seen[m] = 1
        stack.append(m)
        for n in sorted(graph.get(m, ())):
            if seen.get(n) == 1:
                found.append([*stack[stack.index(n):], n])
            elif n not in seen:
                visit(n)
        stack.pop()
        seen[m] = 2

    for m in sorted(graph):
        if m not in seen:
            visit(m)
    return found


def test_import_graph_has_no_cycle() -> None:
    """Through function-level imports too (a package's ``__init__`` counts as a module that
    imports what it re-exports)."""
    cycles = _cycles(GRAPH)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_cycle_check_can_fail() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]


LAYER = {  # who may import whom (docs/DESIGN.md §6): nothing imports upward
    # probe.layout names every file of a run directory (stdlib only): the contract evidence reads;
    # errors and settings (the tool's own waits, passed in) sit below every layer
    "moe_hang.evidence": {"moe_hang.evidence", "moe_hang.errors", "moe_hang.settings",
                          "moe_hang.probe.layout"},
    "moe_hang.analysis": {"moe_hang.analysis", "moe_hang.evidence", "moe_hang.errors",
                          "moe_hang.settings"},
    "moe_hang.probe": {"moe_hang.probe"},
    "moe_hang.report": {"moe_hang.report", "moe_hang.analysis", "moe_hang.evidence",
                        "moe_hang.errors", "moe_hang.settings", "moe_hang.probe"},
    # imported by every layer: it imports none of them
    "moe_hang.settings": {"moe_hang.errors"},
    "moe_hang.errors": set(),
}


@pytest.mark.parametrize("layer", sorted(LAYER))
def test_nothing_imports_upward(layer: str) -> None:
    allowed = LAYER[layer]
    bad = [(m, n) for m, deps in GRAPH.items() if m == layer or m.startswith(layer + ".")
           for n in deps if not any(n == a or n.startswith(a + ".") for a in allowed)]
    assert not bad, bad


def _third_party(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module.split(".")[0])
    return out


def test_pure_layers_import_no_torch_rich_or_processes() -> None:
    bad = {m: sorted(_third_party(p) & {"torch", "rich", "subprocess", "psutil", "typer"})
           for m, p in MODULES.items()
           if m.startswith(("moe_hang.analysis", "moe_hang.evidence"))
           or m in ("moe_hang.settings", "moe_hang.errors")}
    assert not {m: b for m, b in bad.items() if b}


def test_only_report_imports_rich() -> None:
    users = sorted(m for m, p in MODULES.items() if "rich" in _third_party(p)
                   and not m.startswith("moe_hang.report") and m != "moe_hang.cli")
    assert not users, users


# where a verdict is decided, and the modules that only say it
DETECTION = ("align", "blocks", "culprit", "facts", "fallback", "ladder", "mismatch",
             "program", "readings", "source", "timeline", "waitfor", "wronggroup", "ranks")
SENTENCES = ("explain", "advice")


def test_detection_never_imports_the_sentence_builders() -> None:
    bad = [(d, n) for d in DETECTION for n in GRAPH[f"moe_hang.analysis.{d}"]
           if n.rsplit(".", 1)[-1] in SENTENCES]
    assert not bad, bad


# the rule table's conclusions and the JSON reader: the only places a verdict is set
VERDICT_MAKERS = {"moe_hang.analysis.rules", "moe_hang.analysis.failures",
                  "moe_hang.analysis.p2p", "moe_hang.analysis.dumps_only",
                  "moe_hang.analysis.unreached", "moe_hang.analysis.diagnosis",
                  "moe_hang.analysis.conclusion", "moe_hang.analysis.ras.failures",
                  "moe_hang.analysis.ras.launches", "moe_hang.analysis.cycles",
                  "moe_hang.analysis.waiting", "moe_hang.analysis.transport",
                  "moe_hang.analysis.joining", "moe_hang.analysis.roots"}


def _sets_verdict(path: Path) -> list[int]:
    """Lines that make a verdict: ``verdict=`` or ``.verdict =``, and any ``Verdict.X`` that is
    not read (``Conclusion(Verdict.HANG, ...)``, ``v = Verdict.DESYNC``)."""
    tree = ast.parse(path.read_text())
    # read, not made: compared with, a member of a set of verdicts, a key of a lookup
    compared = {id(a) for node in ast.walk(tree) if isinstance(node, ast.Compare)
                for a in ast.walk(node)}
    compared |= {id(e) for node in ast.walk(tree) if isinstance(node, (ast.Tuple, ast.List,
                                                                      ast.Set))
                 for e in node.elts}
    compared |= {id(k) for node in ast.walk(tree) if isinstance(node, ast.Dict)
                 for k in node.keys if k is not None}
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == "verdict":
            lines.append(node.value.lineno)
        targets = node.targets if isinstance(node, ast.Assign) else (
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
        lines.extend(t.lineno for t in targets
                     if isinstance(t, ast.Attribute) and t.attr == "verdict")
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id == "Verdict" and id(node) not in compared):
            lines.append(node.lineno)
    return sorted(set(lines))


def test_verdicts_are_made_only_in_the_rules() -> None:
    """A reader of analysis/rules.py knows every verdict the tool can print."""
    bad = {m: lines for m, p in MODULES.items() if m not in VERDICT_MAKERS
           and (lines := _sets_verdict(p))}
    assert not bad, bad


def test_the_verdict_check_sees_a_verdict_passed_by_position(tmp_path: Path) -> None:
    p = tmp_path / "m.py"
    p.write_text("def f(d):\n    if d.verdict == Verdict.HANG:\n        return 1\n"
                 "    v = Verdict.DESYNC if d else Verdict.HANG\n"
                 "    if d.verdict in (Verdict.HANG, Verdict.CRASH):\n        return 2\n"
                 "    return Conclusion(Verdict.CRASH, [])\n")
    assert _sets_verdict(p) == [4, 7]


_CACHES = {"lru_cache", "cache"}  # a memo kept between calls is state
_MUTATORS = {"append", "extend", "insert", "pop", "popitem", "clear", "update", "setdefault",
             "add", "discard", "remove", "__setitem__"}


def _module_state(path: Path) -> list[str]:
    """Module-level containers that a function changes (a cache, a registry), and globals."""
    tree = ast.parse(path.read_text())
    containers = set()
    for node in tree.body:
        value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
        if isinstance(value, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp,
                              ast.SetComp)) or (isinstance(value, ast.Call)
                                                and ast.unparse(value.func) in
                                                ("dict", "list", "set", "defaultdict")):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            containers.update(t.id for t in targets if isinstance(t, ast.Name))
    found = []
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        found.extend(f"{ast.unparse(d)} on {fn.name}" for d in fn.decorator_list
                     if ast.unparse(d).split("(")[0].rsplit(".", 1)[-1] in _CACHES)
        for node in ast.walk(fn):
            if isinstance(node, ast.Global):
                found.append(f"global {', '.join(node.names)} in {fn.name}")
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and isinstance(node.func.value, ast.Name)
                    and node.func.value.id in containers and node.func.attr in _MUTATORS):
                found.append(f"{node.func.value.id}.{node.func.attr} in {fn.name}")
            if isinstance(node, (ast.Assign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                found.extend(f"{t.value.id}[...] = in {fn.name}" for t in targets
                             if isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name)
                             and t.value.id in containers)
    return found


def test_no_module_level_state_in_analysis_or_evidence() -> None:
    bad = {m: s for m, p in MODULES.items()
           if m.startswith(("moe_hang.analysis", "moe_hang.evidence")) and (s := _module_state(p))}
    assert not bad, bad


def test_the_state_check_can_fail(tmp_path: Path) -> None:
    p = tmp_path / "m.py"
    p.write_text("_CACHE = {}\n\ndef f(k):\n    _CACHE[k] = 1\n    _CACHE.clear()\n")
    assert sorted(_module_state(p)) == ["_CACHE.clear in f", "_CACHE[...] = in f"]
    p.write_text("import functools\n\n@functools.lru_cache(maxsize=8)\ndef g(k):\n"
                 "    return k\n")
    assert _module_state(p) == ["functools.lru_cache(maxsize=8) on g"]


RUN_FILES = {"meta.json", "config.json", "processes.json", "diagnosis.json", "console.log",
             "job.log", "reference.json", "reference.log", "hb.json", "fr.pkl", "tokens.jsonl",
             "posted.jsonl", "fr.saved.pkl",
             "stack.txt", "fatal.txt", "error.json", "groups.json", "dump.json", "dump.err",
             "coverage.json", "result.pt", "pyspy.json", "pyspy.err", "verdict.json",
             "local-diagnosis.json", "analysis.json"}


def test_only_the_layout_spells_a_run_directory_file_name() -> None:
    """docs/DESIGN.md §7: moe_hang/probe/layout.py names every file of a run directory."""
    bad = []
    for m, p in MODULES.items():
        if m == "moe_hang.probe.layout" or m.startswith("moe_hang.testing"):
            continue
        tree = ast.parse(p.read_text())
        docs = {id(n.body[0].value) for n in ast.walk(tree)
                if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef)) and n.body
                and isinstance(n.body[0], ast.Expr)
                and isinstance(n.body[0].value, ast.Constant)}
        bad.extend(f"{m}:{n.lineno} {n.value!r}" for n in ast.walk(tree)
                   if isinstance(n, ast.Constant) and isinstance(n.value, str)
                   and id(n) not in docs
                   and any(n.value == f or n.value.endswith(("/" + f, "." + f))
                           for f in RUN_FILES))
    assert not bad, bad


def test_test_files_have_unique_names() -> None:
    """pytest imports test files by basename (no packages under tests/): two of one name
    stop the whole suite at collection, where running one directory alone passes."""
    names = Counter(p.name for p in (ROOT / "tests").rglob("test_*.py")
                    if "fixtures" not in p.parts)
    assert not [n for n, k in names.items() if k > 1], names.most_common(3)


MAX_MODULE_LINES = 400


def test_modules_and_scripts_stay_under_400_lines() -> None:
    """One job per module: a module (or script) past 400 lines holds two (docs/DESIGN.md §6);
    split it by concern rather than raise the limit."""
    files = [*PKG.rglob("*.py"), *(ROOT / "scripts").rglob("*.py")]
    long = {str(p.relative_to(ROOT)): n for p in files
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, long
