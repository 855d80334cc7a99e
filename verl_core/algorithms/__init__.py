"""Algorithms: each is the loss of one batch plus its config, over the shared engine."""
