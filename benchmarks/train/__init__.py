"""The trainer's benchmarks: overhead, gradient sync, memory budgets, trackers, the GPU check, export."""
