"""Test helpers for te_fuser users: the memory pytest plugin (te_fuser.testing.pytest_plugin)."""
