"""melcache trainer: stream the cached log-mel shards into a DDP/AMP training loop."""
