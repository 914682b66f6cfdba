"""A dictionary's features read on a model: what the Features panel of `glassgpt view` serves.

    latents         the latents of a prompt, spliced with the error term (so the model
                    downstream computes what it always does)
    scan_text       every latent's largest activation in windows spread evenly through a text,
                    and how often each fired (a bounded scan, done once per dictionary)
    top_contexts    the scanned windows where one feature is largest, with its activations
    logit_effects   what a feature's decoder row pushes each token's logit by, through the final
                    norm's gain (and its centring) and the unembedding
    feature_writers each head's, MLP's and embedding's direct push on a feature's pre-activation
                    at a position: the stream's parts times its encoder column, plus a constant
    clamp_hooks     the hooks that set (or scale) a feature at every position while sampling
Notation: T = prompt tokens, F = d_sae (latents), C = width, V = vocabulary, N = scanned windows.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from glassgpt.errors import InputError, ModelError
from glassgpt.hooknames import parse_hook_name
from glassgpt.interp.core import checks
from glassgpt.interp.core.stream import check_sum_of_parts, frozen_norm, norm_gain, residual_parts
from glassgpt.interp.sae.encoding import pre_acts
from glassgpt.interp.sae.model import SAE
from glassgpt.interp.sae.splice import run_with_cache_and_saes, splice_hooks

SCAN_WINDOWS = 64  # windows of a text scanned for a feature's top contexts
SCAN_TOKENS = 32  # tokens a scanned window holds (at most the model's context)
SCAN_BATCH = 16  # windows run at once
RESIDUAL_POINTS = ("hook_resid_pre", "hook_resid_mid", "hook_resid_post")
PART_LAYER = re.compile(r"L(\d+)(H\d+| attn| MLP)")  # a part of block L: a head, its bias, the MLP


@dataclass
class Scan:
    """What the scan of a text found for every latent at once."""

    windows: Tensor  # (N, W) token ids
    best: Tensor  # (N, F): each window's largest activation of each latent
    fired: Tensor  # (F,): positions where each latent was above 0
    positions: int  # N * W


@dataclass(frozen=True)
class FeatureWriters:
    """A feature's pre-activation at one position, split into what wrote it."""

    labels: list[str]  # the stream's parts the dictionary reads: "embed", "L0H1", "L0 MLP", ...
    values: list[float]  # each part's push: the part times the feature's encoder column
    # the pre-activation of a zero input: b_enc[f] (minus b_dec . W_enc[:, f] where the input
    # is centred by b_dec)
    constant: float
    pre: float  # the pre-activation itself, from the spliced run (hook_sae_acts_pre)
    post: float  # the latent after the activation function (hook_sae_acts_post)

    @property
    def total(self) -> float:
        """The parts and the constant added up: `pre`, to float rounding."""
        return sum(self.values) + self.constant


def latents(model: nn.Module, sae: SAE, idx: Tensor) -> Tensor:
    """The dictionary's latents (B, T, F) on ids idx (B, T), spliced with its error term."""
    name = f"{sae.cfg.hook_name_out}.hook_sae_acts_post"
    _, cache = run_with_cache_and_saes(model, idx, [sae], use_error_term=True, names=[name])
    return cache[name].float()


def scan_text(model: nn.Module, sae: SAE, text: np.ndarray | None) -> Scan | None:
    """Every latent's largest activation in each of SCAN_WINDOWS windows spread evenly through
    `text`, and how often each fired; None when the text is shorter than one window."""
    width = min(SCAN_TOKENS, model.config.block_size)
    if text is None or len(text) < width:
        return None
    starts = dict.fromkeys(np.linspace(0, len(text) - width, SCAN_WINDOWS).astype(int).tolist())
    windows = torch.stack([torch.as_tensor(np.asarray(text[s:s + width], dtype=np.int64))
                           for s in starts]).to(sae.W_enc.device)  # (N, W)
    best, fired = [], torch.zeros(sae.cfg.d_sae, dtype=torch.long, device=windows.device)
    for batch in windows.split(SCAN_BATCH):
        acts = latents(model, sae, batch)  # (n, W, F)
        best.append(acts.amax(dim=1))  # (n, F)
        fired += (acts > 0).sum(dim=(0, 1))
    return Scan(windows, torch.cat(best), fired, windows.numel())


def top_contexts(model: nn.Module, sae: SAE, scan: Scan | None, feature: int,
                 count: int) -> tuple[Tensor, Tensor]:
    """The `count` scanned windows (n, W) where the feature is largest, strongest first and
    only where it fired, with its activation at each of their tokens (n, W)."""
    if scan is None:
        return torch.zeros(0, 0, dtype=torch.long), torch.zeros(0, 0)
    peaks = scan.best[:, feature]  # (N,)
    order = [i for i in torch.argsort(peaks, descending=True)[:count].tolist() if peaks[i] > 0]
    windows = scan.windows[order]  # (n, W)
    if not order:
        return windows, torch.zeros(windows.shape)  # (0, W)
    return windows, latents(model, sae, windows)[..., feature]  # (n, W)


def logit_effects(model: nn.Module, sae: SAE, feature: int) -> Tensor | None:
    """What the feature's decoder row W_dec[f] adds to each token's logit (V,), after the final
    norm's gain (and its centring, for a LayerNorm), as the Attribution panel reads a
    direction. None for a dictionary that writes elsewhere than the residual width."""
    direction = sae.W_dec[feature].detach().double()  # (C,)
    if direction.shape[-1] != model.config.n_embd:
        return None
    _, centred = frozen_norm(model.ln_f, direction[None])
    if centred:
        direction = direction - direction.mean()
    direction = direction * norm_gain(model.ln_f).detach().double()
    return model.lm_head.weight.detach().double() @ direction  # (V,)


def writers_unavailable(model: nn.Module, sae: SAE) -> str | None:
    """Why a feature's writers cannot be read for this dictionary and model, or None."""
    reads = parse_hook_name(sae.cfg.hook_name or "")
    if reads.layer is None or reads.module or reads.point not in RESIDUAL_POINTS \
            or sae.cfg.reshape_activations != "none":
        return (f"writers are read for a dictionary on the residual stream "
                f"(blocks.L.hook_resid_pre/mid/post); this one reads {sae.cfg.hook_name}")
    try:
        check_sum_of_parts(model)
    except ModelError as error:
        return str(error)
    return None


def feature_writers(model: nn.Module, sae: SAE, feature: int, idx: Tensor,
                    position: int) -> FeatureWriters:
    """Each head's, MLP's and embedding's direct push on the feature's pre-activation at
    `position` of ids idx (1, T): the parts of the residual stream the dictionary reads
    (`residual_parts`), each times its encoder column, and the constant b_enc[f] - b_dec .
    W_enc[:, f]; they add up to the pre-activation (`pre`, from the spliced run)."""
    why_not = writers_unavailable(model, sae)
    if why_not is not None:
        raise InputError(why_not)
    checks.index("position", position, idx.shape[1])
    _, cache = run_with_cache_and_saes(model, idx, [sae], use_error_term=True)
    labels, parts = residual_parts(model, cache, position)
    reads = parse_hook_name(sae.cfg.hook_name)
    where = reads.point.removeprefix("hook_resid_")
    kept = [i for i, label in enumerate(labels) if reaches(label, reads.layer, where)]
    column = sae.W_enc[:, feature].detach().double()  # (C,)
    values = [float(parts[i][0].detach().double() @ column) for i in kept]
    # pre_acts is affine in its input: x @ column plus its value at a zero input (in float64)
    zero = column.new_zeros(1, column.shape[0])  # (1, C)
    with torch.no_grad():
        constant = float(pre_acts(sae, zero, torch.tensor([feature], device=zero.device)))
    at = f"{sae.cfg.hook_name_out}.hook_sae_acts_"
    return FeatureWriters([labels[i] for i in kept], values, constant,
                          float(cache[at + "pre"][0, position, feature]),
                          float(cache[at + "post"][0, position, feature]))


def reaches(label: str, layer: int, where: str) -> bool:
    """Whether the part `label` is in the stream at blocks.{layer}.hook_resid_{where}."""
    found = PART_LAYER.match(label)
    if found is None:  # the embeddings
        return True
    part_layer = int(found.group(1))
    if part_layer != layer:
        return part_layer < layer
    return where == "post" or (where == "mid" and found.group(2) != " MLP")


def clamp_hooks(sae: SAE, feature: int, value: float | None, scale: float | None
                ) -> list[tuple[str, Any]]:
    """The hooks that splice the dictionary into its point with the feature's latent set to
    `value` (or multiplied by `scale`) at every position, plus the untouched dictionary's error
    term, so that only the edit changes what the model carries on with."""
    def edit(acts: Tensor, name: str) -> Tensor:  # (..., F)
        acts = acts.clone()
        acts[..., feature] = value if value is not None else acts[..., feature] * scale
        return acts

    splice, capture = splice_hooks(
        sae, True, {f"{sae.cfg.hook_name_out}.hook_sae_acts_post": [edit]})
    hooks = [(sae.cfg.hook_name_out, splice)]
    return hooks if capture is None else [(sae.cfg.hook_name, capture), *hooks]
