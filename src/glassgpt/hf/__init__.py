"""Hugging Face interop: import and export GPT-2, Llama and Qwen3 directories.

convert: a run from a HF model and a HF directory from a run (what `glassgpt convert` calls);
interop: the same weights both ways, model to model; architectures: what each HF architecture
is in glassgpt's terms; files: reading HF directories without trusting them.
"""
