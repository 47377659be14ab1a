"""One run's parts and their lifetime: assembly, resume, checkpoints, DCP, metrics, validation, the run folder; imports every room below it."""
