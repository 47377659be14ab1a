"""Training that adapts to what it measures: spike skips, adaptive clipping, noise scale, batch ramp; imports config, optim, parallel."""
