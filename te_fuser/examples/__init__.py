"""Runnable examples: `python -m te_fuser.examples.<name>`."""
