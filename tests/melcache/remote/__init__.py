"""Caches in an object store and a node's local copies (melcache/remote/)."""
