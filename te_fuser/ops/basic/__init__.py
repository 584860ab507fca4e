"""Basic operations: each owns its parameters and quantizers."""
