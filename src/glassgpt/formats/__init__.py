"""File formats other programs read and write, both ways: one room for all of them.

Hugging Face: convert (a run from a HF model and a HF directory from a run: what
`glassgpt convert` calls); interop (the same weights both ways, model to model) moving them by
weight_mapping; architectures, gemma, neox (what each HF architecture is in glassgpt's terms:
the records, their names and settings, GGUF's beside HF's), translation (what a record holds
and the steps the families share), rotary (rotary settings both ways); files (reading HF
directories without trusting them), hf_settings (what a config.json may say).
peft: a LoRA adapter in peft's format. GGUF: gguf (a run as one file for llama.cpp), its
vocabulary in gguf_vocab. TransformerLens: transformer_lens (HookedTransformer's state dict
both ways), transformer_lens_config (HookedTransformerConfig's fields both ways),
transformer_lens_files (its checkpoint's files).
"""
