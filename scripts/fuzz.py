"""Generated jobs with planted faults through the real CLI: the thin command line of
:mod:`moe_hang.testing.fuzz` (``--help`` says everything; ``make fuzz SEED=S N=K``)."""

from moe_hang.testing.fuzz import main
from moe_hang.testing.script import run

if __name__ == "__main__":
    run(main)
