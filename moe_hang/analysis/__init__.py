"""Evidence -> Diagnosis (pure: no torch, no rich, no processes)."""
