"""Sentences and advice for a person, from the facts the rules established (pure)."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import TYPE_CHECKING

from moe_hang.analysis.blocks import EXTRA, SKIP
from moe_hang.analysis.diagnosis import (
    DEFAULT_PG,
    CulpritBasis,
    Divergence,
    MismatchKind,
    RankCollective,
    RankReport,
    fmt_shape,
    pg_label,
)
from moe_hang.evidence.errors import without_build_paths
from moe_hang.evidence.flight_recorder import Collective
from moe_hang.evidence.model import RankError, SizeAbort
from moe_hang.evidence.stacks import Frame, short_path
from moe_hang.evidence.vocab import RankState, agree, who

if TYPE_CHECKING:
    from moe_hang.analysis.align import GroupDivergence
    from moe_hang.analysis.facts import Facts


# "Ranks posted <phrase> at seq N of <group>": a row per kind of analysis.mismatch.KINDS
KIND_PHRASE = {
    MismatchKind.OP: "different collectives",
    MismatchKind.SIZE: "different sizes",
    MismatchKind.DTYPE: "different dtypes",
    MismatchKind.MISSING: "a collective some ranks never reached",
    MismatchKind.ORDER: "the same collectives in different orders",
    MismatchKind.EXTRA: "collectives only some ranks posted",
}


WAITS = "\0waits"  # stands for WAIT_ONE / WAIT_MANY until the ranks are known
WAIT_ONE = "waits on a collective it posted earlier (which one: its Flight Recorder)"
WAIT_MANY = "wait on collectives they posted earlier (which ones: their Flight Recorders)"
WAIT_IN = "a wait on a collective posted earlier (which one: the Flight Recorder)"


def fmt_sizes(c: RankCollective | Collective | None) -> str:
    if c is None:
        return "nothing"
    if c.op == "unknown":  # a wait on a collective posted earlier: which, only a recorder says
        return WAIT_ONE
    sizes = fmt_shape(c.input_sizes)
    text = f"{c.op}({sizes})" if sizes else c.op
    return f"{text} of {c.tag}" if c.tag else text


def site_str(site: Frame | None) -> str:
    return site.short() if site else "unknown line"


def desync_summary(div: Divergence, reports: dict[int, RankReport], culprits: list[int],
                   exits: dict[int, int | None]) -> str:
    """``exits``: the ranks that exited badly, with their exit codes."""
    where = " in backward" if div.phase == "backward" else ""
    # where each posted its side of this collective, else where it is now — only while it
    # is still in that very collective (one that went past it is at another line)
    def now_in_it(r: int) -> Frame | None:
        rep = reports.get(r)
        c = rep.collective if rep is not None else None
        if rep is None or (div.seq is not None and c is not None
                           and (c.pg, c.seq) != (div.pg, div.seq)):
            return None
        return rep.callsite

    callsites = {r: cs for r, c in div.per_rank.items()
                 if (cs := (c.callsite if c is not None else None) or now_in_it(r))}
    # one line for all only where every rank's is known (one unknown may be another line)
    same_site = len({(cs.file, cs.line) for cs in callsites.values()}) == 1 and \
        all(r in callsites for r, c in div.per_rank.items() if c is not None)

    # ranks that did the same thing together: one clause each, however many ranks
    said: dict[str, list[int]] = {}
    for r, c in sorted(div.per_rank.items()):
        if c is None:
            said.setdefault("never posted it", []).append(r)
            continue
        text = WAITS if c.op == "unknown" else fmt_sizes(c)
        if div.kind == MismatchKind.DTYPE and c.op != "unknown":
            # the sizes alike: the dtype is what differs (none where it was not recorded)
            text += f" {'/'.join(dict.fromkeys(c.dtypes))}" if c.dtypes else ""
        if not same_site and r in callsites:
            text += f" at {callsites[r].short()}"
        said.setdefault(text, []).append(r)
    # a wait's clause agrees with its ranks: "rank 1 waits on a collective it posted", "ranks
    # 1-5 wait on collectives they posted"
    parts = [f"{who(rs)} " + text.replace(WAITS, agree(rs, WAIT_ONE, WAIT_MANY))
             for text, rs in said.items()]
    site = f" at {next(iter(callsites.values())).short()}" if same_site and callsites else ""
    del exits  # how each rank ended is in its own line of the report
    tail = ""
    if div.seq is None:
        ops = {c.op for c in div.per_rank.values() if c is not None}
        what = (f"{ops.pop()} at different lines" if div.kind == MismatchKind.MISSING
                and len(ops) == 1 else "different collectives")
        return f"Ranks wait in {what}{where}{site}: " + "; ".join(parts) + tail + "."
    pg_name = pg_label(div.pg, div.pg_desc)
    tags = {r: c.tag for r, c in div.per_rank.items() if c is not None and c.tag}
    if div.kind == MismatchKind.MISSING and len(set(tags.values())) > 1:
        ahead = [r for r in culprits if r in tags]
        behind = [r for r in tags if r not in ahead]
        if ahead and behind:
            skipped, posted = tags[behind[0]], tags[ahead[0]]
            first_ahead = div.per_rank.get(ahead[0])
            op = first_ahead.op if first_ahead is not None else "collective"
            return (f"{who(ahead).capitalize()} never posted the {op} of {skipped}: at seq "
                    f"{div.seq} of {pg_name} its {op} of {posted} paired with "
                    f"{who(behind)}'s {op} of {skipped} (same size, so silently), and "
                    "every later collective paired with the wrong partner" + tail + ".")
    pg = pg_name
    if div.pg != DEFAULT_PG and div.members:
        # a few members by number; a big group by its size (the JSON lists them all)
        pg += (f" (ranks {', '.join(map(str, div.members))})" if len(div.members) <= 8
               else f" ({len(div.members)} ranks)")
    return (f"Ranks posted {KIND_PHRASE[div.kind]} at seq {div.seq} of {pg}{where}{site}: "
            + "; ".join(parts) + tail + ".")


def _plural(op: str, n: int) -> str:
    return f"{n} {op}s" if n != 1 else f"an {op}" if op[:1] in "aeiou" else f"a {op}"


def block_summary(g: GroupDivergence, reports: dict[int, RankReport]) -> str:
    """One side posted collectives the other did not, from ``start`` on: an extra on one side,
    or a skip on the other, or — where nothing decides — either."""
    b = g.block
    assert b is not None
    div = g.div
    first = b.items[0] if b.items else None
    op = first.op if first is not None else "collective"
    site = b.site
    fn = f" from {site.function}()" if site is not None and site.function != "<module>" else ""
    at = f"{fn} at {short_path(site.file)}:{site.line}" if site is not None else ""
    where = f"seq {b.start} of {pg_label(div.pg, div.pg_desc)}"
    n = len(b.items)
    have, lack = who(b.having), who(b.lacking)
    tag = first.tag if first is not None else None
    if b.decided == SKIP and tag and n == 1:  # the probe says which one it was
        text = f"{lack.capitalize()} never posted the {op} of {tag} that {have} posted ({where})"
    elif b.decided == SKIP and site is not None and len(set(b.counts.values())) > 1 \
            and b.counts.get(b.lacking[0], 0) > 0:
        # a run of one collective, one short: counted, as a person reads it in the log
        text = (f"{lack.capitalize()} posted {_plural(op, b.counts[b.lacking[0]])}{at} where "
                f"{have} posted {b.counts[b.having[0]]} ({where} on): "
                f"{agree(b.lacking, 'it', 'they')} skipped {n}")
    elif b.decided == SKIP:
        text = (f"{lack.capitalize()} skipped {_plural(op, n)}{at} that {have} posted "
                f"({where})")
    elif b.decided == EXTRA:
        text = (f"{have.capitalize()} posted {_plural(op, n)}{at} that {lack} never posted "
                f"({where})" + (f", under `{b.condition}`" if b.condition else ""))
    else:
        text = (f"{have.capitalize()} posted {_plural(op, n)}{at} that {lack} did not "
                f"({where}): either {have} posted {agree(b.having, 'an extra', 'extras')} or "
                f"{lack} skipped {agree(b.lacking, 'it', 'them') if n == 1 else 'them'}, and no "
                "earlier step or rank condition says which")
    if b.after:
        text += "; every later pair was mismatched" + (" silently (same shapes)" if
                                                        _same_shapes(g) else "")
    culprits = b.culprits
    now = reports.get(culprits[0]) if b.decided is not None else None
    if now is not None and now.callsite is not None and len(culprits) == 1:
        text += f"; rank {culprits[0]} is now at {now.callsite.short()}"
    return text + "."


def _same_shapes(g: GroupDivergence) -> bool:
    """The block's collectives paired with the others' without a size error: the same op and
    sizes on both sides at the block's first seq."""
    entries = [c for c in g.have.values()]
    return len({(c.op, str(c.input_sizes)) for c in entries}) == 1


def culprit_clause(basis: CulpritBasis, culprits: list[int], confirmed: bool = True) -> str:
    """What the summary adds about the blame: the report says the basis in words; only a
    side inferred from the shape its collective always had is flagged in the sentence."""
    if basis == CulpritBasis.HISTORY and not confirmed and culprits:
        return (" (Earlier steps decide: that collective always had one shape there; the "
                "aborted rank's own size is not recorded, so this is likely, not certain.)")
    return ""


def error_text(err: RankError, limit: int = 160) -> str:
    """``Type: message`` — the message's first sentence, without the build machine's source
    paths gloo puts in front."""
    message = without_build_paths(err.message)
    first = re.split(r"(?<=[.!?])\s", message, maxsplit=1)[0] if message else ""
    if len(first) > limit:
        first = first[: limit - 1].rstrip() + "…"
    return f"{err.type}: {first}" if first else err.type


def waits_text(f: Facts, reports: dict[int, RankReport]) -> str:
    """``rank 0 in all_reduce(8), rank 2 in barrier``: the ranks left waiting."""
    victims = [r for r in f.views if r not in f.killed and r not in f.left
               and reports[r].collective is not None
               and (r in f.waiting or reports[r].state == RankState.EXITED)]
    # ranks in the same collective together: on 1000 ranks, one clause per kind of wait
    by_what: dict[str, list[int]] = {}
    for r in victims:
        c = reports[r].collective
        what = WAIT_IN if c is not None and c.op == "unknown" else fmt_sizes(c)
        by_what.setdefault(what, []).append(r)
    return ", ".join(f"{who(rs)} in {what}" for what, rs in by_what.items())


def waited_text(f: Facts, ranks: Iterable[int]) -> str:
    """`` Ranks 0, 2 wait at a.py:29 on what they posted at a.py:27.``: the ranks whose stack
    is at a wait on a collective posted earlier, one sentence per wait and post line."""
    waits: dict[tuple[str, str], list[int]] = {}
    for r in sorted(ranks):
        if (w := (v := f.views[r]).stack.waited_at) is not None:
            waits.setdefault((site_str(w), site_str(v.site)), []).append(r)
    return "".join(f" {who(rs).capitalize()} {agree(rs, 'waits', 'wait')} at {w} on what "
                   f"{agree(rs, 'it', 'they')} posted at {p}." for (w, p), rs in waits.items())


def abort_detail(aborted: list[int], abort: SizeAbort | None) -> str:
    """``gloo aborted rank 0: it received 51328 bytes where it expected 17408``."""
    detail = f"gloo aborted {who(aborted)}"
    if abort is not None and abort.received is not None:
        detail += f": it received {abort.received} bytes where it expected {abort.expected}"
    return detail
