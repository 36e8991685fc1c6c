"""Helpers for tests and benchmarks that generate evidence in the exact layout real jobs
leave (:mod:`.fr_synth`: Flight Recorder dump sets with one planted fault). The tool itself
never imports this package."""
