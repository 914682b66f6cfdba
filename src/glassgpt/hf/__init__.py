"""Hugging Face interop: import and export GPT-2, Llama and Qwen3 directories."""
