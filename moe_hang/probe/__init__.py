"""What runs inside every rank (stdlib only): the probe, and the run directory's file names."""
