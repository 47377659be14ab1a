"""Derived fields (``python -m preprocess derive``, docs/fields.md): what a field is in the
index and its shards (:mod:`melcache.fields.format`), and how its shards are read
(:mod:`melcache.fields.store`)."""
