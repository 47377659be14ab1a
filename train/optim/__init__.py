"""Optimizer, precision, loss scaler and clipping: what turns gradients into a step; imports config."""
