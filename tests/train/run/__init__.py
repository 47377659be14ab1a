"""One run's parts (train/run/): checkpoints, trackers, validation."""
