"""Resuming the loader: the saved state and its two readers."""
