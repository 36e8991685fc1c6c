"""moe-hang: find, explain and prove the fix for collective deadlocks in distributed PyTorch."""

__version__ = "0.1.0"
