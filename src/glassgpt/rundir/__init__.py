"""A run directory: its config, tokenizer, weights (best and last) and training state."""
