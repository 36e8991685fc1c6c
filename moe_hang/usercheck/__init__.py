"""The user's own model under moe-hang check, from Python (the API and the pytest plugin)."""
