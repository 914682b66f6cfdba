"""The choices and defaults the command line offers, in a module that imports nothing heavy.

`glassgpt --help` builds every command's parser, and a parser needs its flags' choices and
defaults before any work starts. Their homes would be the tokenizers, the data pipeline and the
benchmarks, which import numpy, Hugging Face `tokenizers` and torch; so each constant lives here,
once, and those modules import it from here (and re-export it where they always have).
"""

from __future__ import annotations

# glassgpt.tokenizers
TOKENIZER_KINDS = ("char", "bpe")
DEFAULT_BPE_VOCAB = 1024

# glassgpt.hf.files: what installs the optional Hugging Face extra
INSTALL_HINT = "pip install 'glassgpt[hf]'"

# glassgpt.data.pipeline: memory for text and token ids in flight while preparing
DEFAULT_BUFFER_BYTES = 64 * 2**20

# glassgpt.bench: the model shapes measured by default, and the decoding workload
TRAIN_PRESETS = ("cpu-small", "shakespeare-char")
DECODE_PRESETS = ("shakespeare-char", "gpt2")
PROMPT_LEN = 16
NEW_TOKENS = 128

# glassgpt.bench.ladder: the val loss every rung trains to, and what counts as a close gain
TARGET_LOSS = 1.88  # nanoGPT's published val loss for that recipe
QUICK_TARGET = 3.5  # --quick: the same rungs at a toy size, which every rung reaches
NOISE = 0.10  # from one seed, a gain under 10% is called close (rerun it with several seeds)
