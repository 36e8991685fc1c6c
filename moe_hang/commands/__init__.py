"""One module per verb: repro.py (repro + verify), watch.py, diagnose.py (diagnose + analyze),
and what they share (session.py)."""
