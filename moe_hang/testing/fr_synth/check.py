"""Compare a real dump's schema with a synthetic one's (fr_synth --check-against)."""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any


def _shape(v: Any) -> Any:
    if isinstance(v, dict):
        return {k: _shape(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        inner = sorted({json.dumps(_shape(x), sort_keys=True) for x in v})
        return [type(v).__name__, *inner[:3]]
    return type(v).__name__


def _load(path: Path) -> Any:
    if path.suffix == ".json":
        return json.loads(path.read_text())
    with path.open("rb") as f:
        return pickle.load(f)


def check_against(real: Path, synth: Path) -> int:
    """Load a real dump and a synthetic one through the same code; compare top-level key order,
    entry key order and the type/shape of every field. 0 when they agree."""
    def first(d: Path) -> Path:
        files = sorted((p for p in d.iterdir()
                        if "trace_rank_" in p.name and not p.name.startswith(".")),
                       key=lambda p: (len(p.name), p.name))
        if not files:
            raise SystemExit(f"no dump in {d}")
        return files[0]

    a, b = _load(first(real)), _load(first(synth))
    problems = []
    if list(a) != list(b):
        problems.append(f"top-level keys: real {list(a)} vs synthetic {list(b)}")
    ea, eb = a.get("entries", []), b.get("entries", [])
    if ea and eb:
        if list(ea[0]) != list(eb[0]):
            problems.append(f"entry keys: real {list(ea[0])}\n   vs synthetic {list(eb[0])}")
        for k in ea[0]:
            ta = {json.dumps(_shape(e.get(k)), sort_keys=True) for e in ea}
            tb = {json.dumps(_shape(e.get(k)), sort_keys=True) for e in eb}
            if not ta & tb:
                problems.append(f"entry field {k!r}: real {sorted(ta)} vs synthetic {sorted(tb)}")
    for k in a:
        if k != "entries" and k in b:
            sa, sb = _shape(a[k]), _shape(b[k])
            ra = json.dumps(sa, sort_keys=True)
            if isinstance(sa, dict) and isinstance(sb, dict):
                va = {json.dumps(x, sort_keys=True) for x in sa.values()}
                vb = {json.dumps(x, sort_keys=True) for x in sb.values()}
                if va and vb and not va & vb:
                    problems.append(f"{k}: real values {sorted(va)} vs synthetic {sorted(vb)}")
            elif ra != json.dumps(sb, sort_keys=True):
                problems.append(f"{k}: real {ra} vs synthetic {json.dumps(sb)}")
    for p in problems:
        print("MISMATCH", p)
    print(f"compared {first(real)} with {first(synth)}: "
          f"{'OK' if not problems else f'{len(problems)} mismatch(es)'}")
    return 1 if problems else 0


