"""Direct logit attribution: how much each head and each MLP pushes one token's logit.

In a Pre-LN model the residual stream that reaches the final norm is a sum of parts: the
embeddings, and what every attention head and every MLP wrote into it. With the final norm's
scale frozen at its value on this run, the norm is linear, so the logit splits into one term
per part (plus the norm's own shift), and the terms add up to the logit exactly:

    logit(tok) = sum_parts  norm_frozen(part) . W_U[tok]  +  beta . W_U[tok]

A head's part is its share of the attention's output, `hook_result` (z_h W_O[h]). With
`logit_softcap` the attributed number is the logit before the cap. A Post-LN model renormalises
the stream after every block, so it is no sum of parts: it is refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from glassgpt.errors import InputError
from glassgpt.interp.core import checks
from glassgpt.interp.core.cache import ActivationCache, cached
from glassgpt.interp.core.hooked import check_run_ids, hook_points, run_with_cache
from glassgpt.interp.core.stream import check_sum_of_parts, frozen_norm, norm_gain, residual_parts


@dataclass(frozen=True)
class Attribution:
    """Each part's push on the logit (or on a logit difference) at one position."""

    labels: list[str]  # "embed", "pos_embed", "L0H1", "L0 attn bias", "L0 MLP", ..., "final norm"
    values: Tensor  # (len(labels),), adding up to `logit`
    logit: float  # the model's own logit (difference) before any soft-cap
    heads: Tensor  # (L, H): the heads' values again, as a grid
    mlps: Tensor  # (L,): 0 for a block without an MLP (attn_only)


def logit_attribution(model: nn.Module, ids: Tensor, token: int, pos: int = -1, *,
                      against: int | None = None,
                      cache: ActivationCache | None = None) -> Attribution:
    """Each head's and MLP's direct push on `token`'s logit at `pos` (minus `against`'s, when
    given), averaged over the batch; the values add up to the logit (difference). `cache`:
    `run_with_cache(model, ids)`'s, when the caller has it already (one forward pass less)."""
    hook_points(model)
    check_sum_of_parts(model)
    check_run_ids(ids)
    checks.position("pos", pos, ids.shape[1])
    checks.token_id("token", token, model.config.vocab_size)
    if against is not None:
        checks.token_id("against", against, model.config.vocab_size)
    if cache is None:
        _, cache = run_with_cache(model, ids, stop_at_layer=model.config.n_layer)  # no logits
    else:
        check_cache_of(cache, model, ids)
    labels, parts = residual_parts(model, cache, pos)
    stream = cached(cache, f"blocks.{model.config.n_layer - 1}.hook_resid_post")[:, pos]  # (B, C)
    scale, centred = frozen_norm(model.ln_f, stream)
    direction = model.lm_head.weight[token].double()  # (C,)
    if against is not None:
        direction = direction - model.lm_head.weight[against].double()
    gamma = norm_gain(model.ln_f).double() * direction  # (C,)
    values = []
    for part in parts:
        part = part.double()
        if centred:
            part = part - part.mean(-1, keepdim=True)
        values.append(((part / scale) @ gamma).mean())
    if getattr(model.ln_f, "bias", None) is not None:
        labels.append("final norm")
        values.append(model.ln_f.bias.double() @ direction)
    values = torch.stack(values)
    return Attribution(labels, values, raw_logit(model, stream, token, against),
                       *grids(model, labels, values))


def check_cache_of(cache: object, model: nn.Module, ids: Tensor) -> None:
    """A cache handed in must be this model's run of these ids: parts of another run would add
    up to some other logit. An ActivationCache knows its run; a plain mapping is held to the
    shape the run would have."""
    if isinstance(cache, ActivationCache) and cache.ids is not None:
        if cache.model is not model:
            raise InputError("the cache was made by another model: pass cache=None or "
                             "run_with_cache(model, ids)'s cache")
        if cache.ids.shape != ids.shape or not torch.equal(cache.ids.cpu(), ids.cpu()):
            raise InputError(f"the cache is a run of other token ids ({tuple(cache.ids.shape)}) "
                             f"than ids {tuple(ids.shape)}: pass the ids it was made from")
        return
    if not isinstance(cache, Mapping):
        raise InputError(f"cache must be run_with_cache's ActivationCache, got "
                         f"{type(cache).__name__}")
    want = (*ids.shape, model.config.n_embd)
    embed = cached(cache, "hook_embed")
    if tuple(embed.shape) != want:
        raise InputError(f"the cache's hook_embed is {tuple(embed.shape)} but this model's run "
                         f"of ids {tuple(ids.shape)} makes {want}")


def raw_logit(model: nn.Module, stream: Tensor, token: int, against: int | None) -> float:
    """The model's own logit (difference) from the final stream (B, C), before any soft-cap."""
    with torch.no_grad():
        logits = model.lm_head(model.ln_f(stream))  # (B, V)
    value = logits[:, token] - (0 if against is None else logits[:, against])
    return float(value.double().mean())


def grids(model: nn.Module, labels: list[str], values: Tensor) -> tuple[Tensor, Tensor]:
    L, H = model.config.n_layer, model.config.n_head
    by_label = dict(zip(labels, values.tolist(), strict=True))
    heads = torch.tensor([[by_label[f"L{l}H{h}"] for h in range(H)] for l in range(L)])
    mlps = torch.tensor([by_label.get(f"L{l} MLP", 0.0) for l in range(L)])  # attn_only: 0
    return heads, mlps
