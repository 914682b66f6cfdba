"""`HookedGPT`: a glassgpt GPT with TransformerLens's face, on which TransformerLens's and
ARENA's code runs unchanged. The class is `.model`'s; its hooks (`add_hook`, `hooks()`,
`reset_hooks`) are `.hooks`'s, the tokenisation methods and what BOS is `.tokens`'s, the
weights in TransformerLens's layout `.weights`'s (`W_Q @ W_K` a `FactoredMatrix`,
`.factored`'s), `fold_ln` / `center_writing_weights` / `center_unembed` `.process`'s. Its
settings in TransformerLens's names (`cfg`) and TransformerLens's checkpoint format are file
formats: glassgpt.formats.transformer_lens_config's and glassgpt.formats.transformer_lens's.
"""

from glassgpt.interp.hooked_gpt.model import HookedGPT, loss_fn

__all__ = ["HookedGPT", "loss_fn"]
