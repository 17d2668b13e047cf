"""Pure array functions (no parameters, no Flax). Each fast path has a slow reference beside it."""
