"""Inputs: one file per corpus layout, and what reads audio and metadata; imports melcache and nothing of preprocess outside this room."""
