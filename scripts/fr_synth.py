"""Synthesize Flight Recorder dump sets in torch's own format, with one planted fault: the thin
command line of :mod:`moe_hang.testing.fr_synth` (``--help`` says everything)."""


from moe_hang.testing.fr_synth import main
from moe_hang.testing.script import run

if __name__ == "__main__":
    run(main)
