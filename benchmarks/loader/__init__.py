"""The loader's benchmarks: throughput, batch plans, schedules, padding, elastic resume."""
