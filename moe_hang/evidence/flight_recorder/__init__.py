"""torch's Flight Recorder dumps, read in four steps, one module each — pure (no torch):

1. :mod:`.find` — which dump files a PATH names (a directory, a prefix, one file), grouped
   into sets; what named nothing usable;
2. :mod:`.load` — one file's bytes (pickle, read with an unpickler that refuses every global,
   or JSON) into a mapping, then :class:`FRDump`; :mod:`.load_sets` loads whole sets, in
   worker processes when they are large (the only module here that starts processes);
3. :mod:`.parse` — a whole dump's mapping (backend, groups, completion, windowing, coalesced
   ops, each group's status); :mod:`.parse_entry` — one entry (op names, sizes, frames);
4. :mod:`.records` — what a dump becomes (:class:`Collective`, :class:`P2PEntry`,
   :class:`PgStatus`, :class:`FRDump`) and :class:`DumpError`.

:mod:`.postmortem` turns loaded sets into post-mortem :class:`~moe_hang.evidence.model.Evidence`
(it imports the evidence model, so this package's ``__init__`` does not import it). A new dump
format touches :mod:`.parse` (and :mod:`.parse_entry` for a new field); every format torch
2.4–2.13 writes is described in docs/flight_recorder_formats.md.
"""

from moe_hang.evidence.flight_recorder.load import (
    RefusedGlobal,
    load,
    load_dir,
    load_raw,
    loads,
    rank_from_filename,
)
from moe_hang.evidence.flight_recorder.parse import detect_backend, parse_dump
from moe_hang.evidence.flight_recorder.parse_entry import entry_to_collective, op_name, parse_ranks
from moe_hang.evidence.flight_recorder.records import (
    DEFAULT_CONTEXT,
    DEFAULT_PG,
    HISTORY_BUDGET,
    Collective,
    DumpError,
    FRDump,
    P2PEntry,
    PgStatus,
    Window,
)

__all__ = [
    "DEFAULT_CONTEXT",
    "DEFAULT_PG",
    "HISTORY_BUDGET",
    "Collective",
    "DumpError",
    "FRDump",
    "P2PEntry",
    "PgStatus",
    "RefusedGlobal",
    "Window",
    "detect_backend",
    "entry_to_collective",
    "load",
    "load_dir",
    "load_raw",
    "loads",
    "op_name",
    "parse_dump",
    "parse_ranks",
    "rank_from_filename",
]
