"""Training: the trainer, optimizers, evaluation, metrics and the run lifecycle."""
