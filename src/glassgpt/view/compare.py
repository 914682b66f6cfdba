"""The Compare panel's numbers: what a fine-tune changed (`glassgpt view RUN2 --compare RUN`).

    tokens      each prompt token's log-probability under the tuned model and the base, and
                their difference (what the tune made likelier, token by token)
    weights     how far each layer's weights moved: ||W_tuned - W_base|| / ||W_base|| for each
                head's slices of the attention projections (q, k, v, o) and each MLP; the
                parameters in neither (embeddings, norms, attention biases) each by name
    heads       how far each head's output moved on the prompt: ||r_tuned - r_base|| /
                ||r_base|| over its positions (hook_result, each head's share of attn_out)
    attention   one head's pattern on the prompt, before and after

The two runs must have the same shape and the same tokenizer (a fine-tune of one by the other);
a run whose adapter is merged on loading compares as its merged weights. Both models run on the
view's model thread, one after the other, on the view's device. The numbers are
glassgpt.interp.methods.diffing's; this module loads the base, parses the requests and shapes
the answers.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from glassgpt.errors import GlassGPTError, InputError
from glassgpt.interp.core.hooked import run_with_cache
from glassgpt.interp.methods.diffing import (
    check_comparable,
    head_output_changes,
    other_changes,
    token_logprobs,
    weight_changes,
)
from glassgpt.model import GPT
from glassgpt.rundir.checkpoint import load_model, read_run_config
from glassgpt.tokenizers import Tokenizer, same_tokenizer
from glassgpt.view import requests as req
from glassgpt.view.values import View, rounded

NO_BASE = "this view compares with no base: start it with glassgpt view RUN2 --compare RUN"

# The requests of the panel's routes (glassgpt.view.requests checks each field's type).
TOKENS = {"prompt": req.PROMPT}
CHANGES = {"prompt": req.PROMPT}
PATTERNS = {"prompt": req.PROMPT, "layer": req.Field((int,)), "head": req.Field((int,))}


class Comparison:
    """The tuned run being viewed and the base it is compared with."""

    def __init__(self, view: View, base: GPT | None, tuned_base_dtype: str | None = None):
        self.view, self.base = view, base
        self._weights: dict[str, Any] | None = None  # the prompt does not change them
        if base is not None:
            check_comparable(view.model, base)
        # A LoRA tune on a bf16 base stores that base rounded: the weight maps compare with
        # the base as the tune saw it, or every weight would read as moved by the rounding.
        self.weights_base = base
        if base is not None and tuned_base_dtype == "bfloat16":
            self.weights_base = copy.deepcopy(base).to(torch.bfloat16).to(torch.float32)

    def available(self) -> dict[str, Any]:
        return {"available": self.base is not None}

    def _base(self) -> GPT:
        if self.base is None:
            raise InputError(NO_BASE)
        return self.base

    def tokens(self, prompt: str) -> dict[str, Any]:
        """Each token's log-probability given the tokens before it, tuned and base."""
        base, encoded = self._base(), self.view.encode(prompt)
        tuned_lp = token_logprobs(self.view.model, encoded.idx)  # (T - 1,)
        base_lp = token_logprobs(base, encoded.idx)
        return {"tokens": [self.view.token_text(i) for i in encoded.ids],
                "tuned": rounded(tuned_lp), "base": rounded(base_lp),
                "difference": rounded(tuned_lp - base_lp),
                "mean_difference": float((tuned_lp - base_lp).mean()) if len(tuned_lp) else 0.0}

    def changes(self, prompt: str) -> dict[str, Any]:
        """How far each head's weights and output moved, and each MLP's weights (layer x head
        maps, and the largest movers named)."""
        base, encoded = self._base(), self.view.encode(prompt)
        if self._weights is None:  # the weights' maps, once: the same for every prompt
            before = self.weights_base
            weights = weight_changes(self.view.model, before)
            self._weights = {"weights": {name: rounded(v) for name, v in weights.items()},
                             "elsewhere": other_changes(self.view.model, before)}
        outputs = head_output_changes(self.view.model, base, encoded.idx)
        return {**self._weights, "outputs": rounded(outputs), "top_outputs": top_heads(outputs)}

    def attention(self, prompt: str, layer: int, head: int) -> dict[str, Any]:
        """One head's attention on the prompt, before (base) and after (tuned) the tune."""
        base, encoded = self._base(), self.view.encode(prompt)
        config = self.view.model.config
        if not (0 <= layer < config.n_layer and 0 <= head < config.n_head):
            raise InputError(f"layer {layer}, head {head} does not exist: layers 0.."
                             f"{config.n_layer - 1}, heads 0..{config.n_head - 1}")
        name = f"blocks.{layer}.attn.hook_pattern"
        before = run_with_cache(base, encoded.idx, name)[1][name][0, head]  # (T, T)
        after = run_with_cache(self.view.model, encoded.idx, name)[1][name][0, head]
        return {"layer": layer, "head": head, "before": rounded(before),
                "after": rounded(after), "largest_change": float((after - before).abs().max())}


def load_comparison(view: View, base_dir: str | Path, checkpoint: str = "best") -> Comparison:
    """The view's run compared with the run at `base_dir` (its `checkpoint` weights, on the
    view's device); a base that cannot be loaded or compared is refused in one line."""
    device = view.model.lm_head.weight.device
    try:
        base, tokenizer = load_model(base_dir, device, checkpoint=checkpoint)
        check_same_tokens(view.tokenizer, tokenizer)
        run_dir = getattr(view, "run_dir", None)
        tuned_extra = {} if run_dir is None else read_run_config(run_dir).get("extra") or {}
        return Comparison(view, base, tuned_extra.get("base_dtype"))
    except GlassGPTError as error:
        raise InputError(f"--compare: {error}") from None


def check_same_tokens(tuned: Tokenizer, base: Tokenizer) -> None:
    """Token t must be the same text in both runs, or their log-probabilities compare nothing."""
    if not same_tokenizer(tuned, base):
        raise InputError(f"the runs' tokenizers differ ({tuned.kind}, {tuned.vocab_size} tokens "
                         f"here; {base.kind}, {base.vocab_size} in the base): compare a "
                         f"fine-tune with the run it was tuned from")


def top_heads(values: Tensor, k: int = 5) -> list[dict[str, Any]]:
    """The k (layer, head) cells with the largest values."""
    flat = values.flatten()
    order = flat.argsort(descending=True)[:k].tolist()
    n_head = values.shape[1]
    return [{"layer": i // n_head, "head": i % n_head, "value": float(flat[i])} for i in order]
