"""Inputs: one file per corpus layout, and the audio and metadata readers; imports melcache only."""
