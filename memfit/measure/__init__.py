"""What the profiler and the runtime both measure with: the training step, memory meters, timed steps."""
