"""The trainer (train/): config, loop, model contract, adaptation, memory, faults."""
