"""Caches away from this machine: ``s3://`` objects read and written with retries
(:mod:`melcache.remote.objectstore`) and a node's local copies of their shards
(:mod:`melcache.remote.disk_cache`)."""
