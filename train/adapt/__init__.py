"""Training that adapts to what it measures: the step's measures, spike skips, noise scale, batch ramp (adaptive clipping is optim's); imports config, optim, parallel."""
