"""The streaming loader (melcache/loader/) over caches made by the real build."""
