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
view's model thread, one after the other, on the view's device.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from glassgpt.errors import GlassGPTError, InputError
from glassgpt.interp.hooked import run_with_cache
from glassgpt.interp.hooked_gpt.weights import head_weight, output_weight
from glassgpt.model import GPT
from glassgpt.rundir.checkpoint import load_model, read_run_config
from glassgpt.tokenizers import Tokenizer, same_tokenizer
from glassgpt.view import requests as req
from glassgpt.view.values import View, rounded

SHAPE_FIELDS = ("vocab_size", "n_layer", "n_head", "n_embd", "n_kv_head", "head_dim",
                "activation", "norm", "position", "attn_only")
PROJECTIONS = ("q", "k", "v", "o")
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
            check_comparable(view, base)
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


def check_comparable(view: View, base: GPT) -> None:
    """The base must have the tuned run's shape (a fine-tune keeps it)."""
    tuned = view.model.config
    for field in SHAPE_FIELDS:
        if getattr(tuned, field) != getattr(base.config, field):
            raise InputError(f"the runs differ in {field} ({getattr(tuned, field)} here, "
                             f"{getattr(base.config, field)} in the base): compare a "
                             f"fine-tune with the run it was tuned from")


def check_same_tokens(tuned: Tokenizer, base: Tokenizer) -> None:
    """Token t must be the same text in both runs, or their log-probabilities compare nothing."""
    if not same_tokenizer(tuned, base):
        raise InputError(f"the runs' tokenizers differ ({tuned.kind}, {tuned.vocab_size} tokens "
                         f"here; {base.kind}, {base.vocab_size} in the base): compare a "
                         f"fine-tune with the run it was tuned from")


def token_logprobs(model: GPT, idx: Tensor) -> Tensor:
    """idx (1, T) -> log p(token t | tokens < t) for t = 1..T-1, (T - 1,)."""
    with torch.no_grad():
        logits, _ = model(idx)  # (1, T, V)
    logprobs = torch.log_softmax(logits[0, :-1].double(), -1)  # (T - 1, V)
    return logprobs.gather(1, idx[0, 1:, None])[:, 0]


def relative_change(after: Tensor, before: Tensor, dims: tuple[int, ...]) -> Tensor:
    """||after - before|| / ||before|| over `dims` (0 where before is all zeros)."""
    change = (after - before).double().square().sum(dims).sqrt()
    size = before.double().square().sum(dims).sqrt()
    return torch.where(size > 0, change / size.clamp(min=1e-30), change)


def weight_changes(tuned: GPT, base: GPT) -> dict[str, Tensor]:
    """Per layer and head, how far q, k, v and o moved ((L, H) each, heads of the query side:
    a K/V head shared by several query heads is counted for each), and per layer the MLP
    ((L, 1): all its matrices together)."""
    n_layer, n_head = tuned.config.n_layer, tuned.config.n_head
    maps = {name: torch.zeros(n_layer, n_head, dtype=torch.float64) for name in PROJECTIONS}
    maps["mlp"] = torch.zeros(n_layer, 1, dtype=torch.float64)
    for layer in range(n_layer):
        after, before = head_weights(tuned, layer), head_weights(base, layer)
        for name in PROJECTIONS:
            maps[name][layer] = relative_change(after[name], before[name], (1, 2))
        mlp_after, mlp_before = mlp_weights(tuned, layer), mlp_weights(base, layer)
        if mlp_before is not None:
            maps["mlp"][layer, 0] = relative_change(mlp_after, mlp_before, (0,))
    return maps


def head_weights(model: GPT, layer: int) -> dict[str, Tensor]:
    """Each query head's slices of its layer's projections: W_Q, W_K, W_V (H, C, d) and W_O
    (H, d, C) in TransformerLens's layout (K/V heads repeated per query head)."""
    attn = model.blocks[layer].attn
    with torch.no_grad():
        return {**{name: head_weight(attn, name) for name in ("q", "k", "v")},
                "o": output_weight(attn)}


def mlp_weights(model: GPT, layer: int) -> Tensor | None:
    """Every weight of the layer's MLP, flattened into one vector (None: no MLP)."""
    mlp = model.blocks[layer].ffn  # None in an attn_only model
    if mlp is None:
        return None
    return torch.cat([p.detach().flatten() for p in mlp.parameters()])


def other_changes(tuned: GPT, base: GPT) -> list[dict[str, Any]]:
    """The parameters the maps leave out (embeddings, norms, the attention's biases and norms),
    each with its relative change, largest first; those that did not move are left out."""
    mapped = re.compile(r"blocks\.\d+\.(ffn\.|attn\.(qkv|proj)\.weight$)")
    before = dict(base.named_parameters())
    moved = [{"name": name, "change": float(relative_change(p.detach(), before[name].detach(),
                                                            tuple(range(p.dim()))))}
             for name, p in tuned.named_parameters() if not mapped.match(name)]
    return sorted((m for m in moved if m["change"] > 0), key=lambda m: -m["change"])


def head_output_changes(tuned: GPT, base: GPT, idx: Tensor) -> Tensor:
    """(L, H): how far each head's output (hook_result) moved on the prompt."""
    names = [f"blocks.{layer}.attn.hook_result" for layer in range(tuned.config.n_layer)]
    _, after = run_with_cache(tuned, idx, names)
    _, before = run_with_cache(base, idx, names)
    return torch.stack([relative_change(after[n][0], before[n][0], (0, 2)) for n in names])


def top_heads(values: Tensor, k: int = 5) -> list[dict[str, Any]]:
    """The k (layer, head) cells with the largest values."""
    flat = values.flatten()
    order = flat.argsort(descending=True)[:k].tolist()
    n_head = values.shape[1]
    return [{"layer": i // n_head, "head": i % n_head, "value": float(flat[i])} for i in order]
