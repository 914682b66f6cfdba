"""Adapters trained on a frozen model and kept apart from its weights: LoRA (`lora.py`), added
to the glass model from outside it, and the files a run keeps them in."""
