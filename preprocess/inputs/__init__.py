"""Inputs: what a corpus holds and how it is read (its layouts, the records they yield, its audio); imports melcache only."""
