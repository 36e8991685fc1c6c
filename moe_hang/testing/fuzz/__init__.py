"""A fault generator that runs real jobs (issue 18): small distributed training jobs of several
shapes (plain collectives, DDP, FSDP2 with and without experts, DTensor, a 2-D mesh, a
pipeline), each with one fault planted from a catalogue, rendered as plain Python files that
import only torch; the ground truth comes from the generator (which rank, which line, which
verdicts) in the accuracy corpus' own terms, and every job runs through the real CLI.

Modules, one job each: :mod:`.events` (what a rank does, as records), :mod:`.catalogue` (the
fault kinds), :mod:`.families` (the job shapes), :mod:`.plant` (a fault applied to a job's
steps), :mod:`.render` (the job's source), :mod:`.simulate` (where every rank ends up),
:mod:`.draw` (seeded choices), :mod:`.truth` (the ground truth), :mod:`.corpus` (truth as a
corpus ``Case`` and its source), :mod:`.runner` (runs and scores through the corpus harness),
:mod:`.report` (table, JSON, misses), :mod:`.cli` (``scripts/fuzz.py``)."""

from moe_hang.testing.fuzz.cli import main

__all__ = ["main"]
