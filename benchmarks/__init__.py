"""The scripts behind docs/results.md, in rooms: common/ (shared helpers) < build/, loader/,
train/, store/ (one per stage) < results.py (reruns them into the docs)."""
