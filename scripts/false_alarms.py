"""False alarms of ``diagnose`` on healthy generated jobs at random moments (issue 28): the thin
command line of :mod:`moe_hang.testing.fuzz.alarms` (``--help`` says everything)."""

from moe_hang.testing.fuzz.alarms import main
from moe_hang.testing.script import run

if __name__ == "__main__":
    run(main)
