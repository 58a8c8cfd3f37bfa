"""Development helpers shared by tests and benchmarks (not part of the package)."""
