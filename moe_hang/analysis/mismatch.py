"""The ways ranks can disagree at one sequence number of a group — one row each: how it is
detected and how two ranks agree on it (for the majority vote) (docs/DESIGN.md §8). A new kind
is a new row here, its words a row of ``explain.KIND_PHRASE`` and ``advice.KIND_ADVICE``.
Detection only: nothing here builds a sentence. Pure."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from moe_hang.analysis.diagnosis import MismatchKind
from moe_hang.evidence.flight_recorder import Collective
from moe_hang.evidence.ops import SAME_SIZE_OPS


def ops_match(a: Collective, b: Collective) -> bool:
    if a.op == b.op:
        return True
    # gloo implements DTensor's reduce-scatter as an all-reduce; the probe names the intent.
    mixed = "probe" in (a.source, b.source) and a.source != b.source
    return mixed and {a.op, b.op} <= {"reduce_scatter", "all_reduce"}


def _sizes_differ(base: Collective, c: Collective) -> bool:
    return (base.op in SAME_SIZE_OPS and bool(c.input_sizes) and bool(base.input_sizes)
            and c.input_sizes != base.input_sizes)


def _dtypes_differ(base: Collective, c: Collective) -> bool:
    return bool(c.dtypes) and bool(base.dtypes) and c.dtypes != base.dtypes


def _same_sizes(a: Collective, b: Collective) -> bool:
    return (a.op, a.input_sizes) == (b.op, b.input_sizes)


def _same_dtypes(a: Collective, b: Collective) -> bool:
    return (a.op, a.dtypes) == (b.op, b.dtypes)


@dataclass(frozen=True)
class KindRow:
    kind: MismatchKind
    # does ``other`` differ from ``base`` in this way? None: not seen from a pair of entries
    differs: Callable[[Collective, Collective], bool] | None
    same: Callable[[Collective, Collective], bool]  # do two ranks agree on this point?


# Checked in this order: a different op makes sizes and dtypes meaningless.
KINDS: tuple[KindRow, ...] = (
    KindRow(MismatchKind.OP, lambda a, b: not ops_match(a, b), ops_match),
    KindRow(MismatchKind.SIZE, _sizes_differ, _same_sizes),
    KindRow(MismatchKind.DTYPE, _dtypes_differ, _same_dtypes),
    KindRow(MismatchKind.MISSING, None, ops_match),
    KindRow(MismatchKind.ORDER, None, ops_match),
    KindRow(MismatchKind.EXTRA, None, ops_match),
)
ROW = {row.kind: row for row in KINDS}


def mismatch_kind(colls: list[Collective]) -> MismatchKind | None:
    """The first way the ranks' entries at one sequence number differ, or None."""
    base = colls[0]
    for row in KINDS:
        if row.differs is not None and any(row.differs(base, c) for c in colls[1:]):
            return row.kind
    return None
