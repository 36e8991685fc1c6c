"""The rule tables of README.md and docs/DESIGN.md, generated from the one table
(``moe_hang.analysis.rules.RULES``): between ``<!-- rules:begin -->`` and
``<!-- rules:end -->`` in each.

    python scripts/rule_table.py          # rewrite them
    python scripts/rule_table.py --check  # exit 1 where a table differs from the code
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from moe_hang.analysis.rules import rule_table
from moe_hang.testing.script import run

ROOT = Path(__file__).resolve().parent.parent
DOCS = (ROOT / "README.md", ROOT / "docs" / "DESIGN.md")
BEGIN, END = "<!-- rules:begin -->", "<!-- rules:end -->"


def with_table(text: str) -> str | None:
    """``text`` with its table replaced by the code's; None where it has no markers."""
    if BEGIN not in text or END not in text:
        return None
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{rule_table()}{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="only say whether they are current")
    args = ap.parse_args(argv)
    stale = []
    for path in DOCS:
        text = path.read_text()
        new = with_table(text)
        if new is None:
            print(f"{path.relative_to(ROOT)}: no {BEGIN} ... {END} markers", file=sys.stderr)
            return 1
        if new != text:
            stale.append(path)
            if not args.check:
                path.write_text(new)
    for path in stale:
        print(f"{path.relative_to(ROOT)}: {'stale' if args.check else 'rewritten'}")
    return 1 if stale and args.check else 0


if __name__ == "__main__":
    run(main)
