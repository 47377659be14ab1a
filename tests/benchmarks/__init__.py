"""The benchmarks run end to end on small inputs: every row docs/results.md reads."""
