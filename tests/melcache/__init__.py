"""The shard contract and the ways to read a cache (melcache/)."""
