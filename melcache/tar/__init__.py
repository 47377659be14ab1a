"""Tar I/O of a cache's shards: the writer of its WebDataset samples (:mod:`.writer`) and the
readers that walk them (:mod:`.reader`), beside each other so that what one writes the other
reads; :mod:`melcache.format` says what the members hold."""
