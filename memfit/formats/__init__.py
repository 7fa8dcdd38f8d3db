"""The file formats: what the profiler measured (profile) and what a plan chose (schedule)."""
