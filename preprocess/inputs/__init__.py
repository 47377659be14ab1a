"""Inputs: what a corpus holds and how it is read (its layouts, the records they yield, its audio, --where); imports melcache only."""
