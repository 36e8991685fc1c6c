"""Files -> typed records, before any reasoning (pure: no torch, rich or processes)."""
