"""Training: data, Quantile Balancing, optimizer, checkpoints, metrics and the loop."""
