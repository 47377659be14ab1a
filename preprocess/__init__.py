"""melcache build stage: decode a speech corpus once into length-bucketed log-mel shards."""

__version__ = "0.1.0"
