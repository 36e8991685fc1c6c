"""Word wrapping that never breaks a word, and paths a person can read at 80 columns.

rich folds a word longer than its column (``in_collecti/ve``, ``moe_hang/wo/rker.py``); here a
line only ever breaks at whitespace. A word wider than the whole line (a very long path) stays
whole on a line of its own: the terminal wraps it, and :func:`screen_lines` counts it as the
rows it takes.
"""

from __future__ import annotations

import os
import re

from rich.cells import cell_len
from rich.text import Text

from moe_hang.evidence.stacks import short_path

_WORD = re.compile(r"\S+")
_SITE = re.compile(r"\S*?/(?:site|dist)-packages/")


def display_path(path: str) -> str:
    """Relative to the working directory when under it, else without the site-packages."""
    try:
        rel = os.path.relpath(path)
        if not rel.startswith(".."):
            return rel
    except ValueError:
        pass
    return short_path(path)


def shorten_paths(text: str) -> str:
    """Absolute paths inside a sentence (the analysis writes them whole): the working
    directory's prefix and everything up to ``site-packages/`` dropped, nothing split."""
    cwd = os.getcwd().rstrip("/") + "/"
    if cwd != "/":
        text = re.sub(r"(?<![\w./-])" + re.escape(cwd), "", text)
    return _SITE.sub("", text)


def wrap(text: Text | str, width: int, *, indent: int = 0, hang: int | None = None) -> list[Text]:
    """``text`` as lines of at most ``width`` cells, broken only at whitespace.

    ``indent`` spaces start the first line, ``hang`` (default: ``indent``) every further
    line. Newlines in ``text`` start new lines. A word wider than the line is kept whole."""
    src = Text(text) if isinstance(text, str) else text
    hang = indent if hang is None else hang
    out: list[Text] = []
    for para in src.split("\n", allow_blank=True):
        out.extend(_wrap_line(para, width, indent if not out else hang, hang))
    return out


def _wrap_line(line: Text, width: int, first: int, hang: int) -> list[Text]:
    plain = line.plain
    words = [(m.start(), m.end()) for m in _WORD.finditer(plain)]
    if not words:
        return [Text(" " * first)] if plain else [Text("")]
    out: list[Text] = []
    start, end = words[0]
    pad = first
    for w_start, w_end in words[1:]:
        # the candidate line runs from the line's first word to the end of this one
        if pad + cell_len(plain[start:w_end]) > width:
            out.append(_piece(line, start, end, pad))
            start, pad = w_start, hang
        end = w_end
    out.append(_piece(line, start, end, pad))
    return out


def _piece(line: Text, start: int, end: int, pad: int) -> Text:
    piece = Text(" " * pad)
    piece.append_text(line[start:end])
    return piece


def screen_lines(lines: list[Text] | list[str], width: int) -> int:
    """The terminal rows ``lines`` take at ``width`` columns (a longer line wraps)."""
    total = 0
    for line in lines:
        n = cell_len(line.plain if isinstance(line, Text) else line)
        total += max(1, -(-n // width))
    return total


def clip(lines: list[Text], keep: int, width: int, mark: str = " …") -> list[Text]:
    """The first ``keep`` lines, the last one ending in ``mark`` (words dropped to make room,
    never cut)."""
    if len(lines) <= keep:
        return lines
    kept = lines[:keep]
    last = kept[-1].copy()
    while cell_len(last.plain) + cell_len(mark) > width and " " in last.plain.strip():
        cut = last.plain.rstrip().rfind(" ")
        last = last[:cut]
    last.rstrip()
    last.append(mark, style="dim")
    kept[-1] = last
    return kept
