"""The optimizer: the memory/time model and the integer programs over it (no torch needed)."""
