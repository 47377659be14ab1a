"""What several benchmarks share: corpora, caches, an S3 server, timers; no benchmark of its own."""
