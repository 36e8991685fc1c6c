"""Synthesize Flight Recorder dump sets in torch's own format, with one planted fault: the thin
command line of :mod:`moe_hang.testing.fr_synth` (``--help`` says everything)."""

import sys

from moe_hang.testing.fr_synth import main

if __name__ == "__main__":
    sys.exit(main())
