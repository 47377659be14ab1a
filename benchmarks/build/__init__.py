"""The build's benchmarks: throughput, planning at scale, derive."""
