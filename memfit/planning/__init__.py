"""Planning: the memory/time model and the integer programs over it (no torch needed).

The names below are what the CLI offers; they live here, apart from the solvers, so that
``memfit --help`` and its usage errors answer without importing torch or a solver."""

SOLVERS = ("cpsat", "cbc", "dp")
BASELINE_NAMES = ("none", "full", "every-k", "sqrt", "first-k", "greedy")
STRATEGY_NAMES = ("ilp", *BASELINE_NAMES)
