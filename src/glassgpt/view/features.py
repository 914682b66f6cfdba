"""The Features panel's numbers: sparse dictionaries (`glassgpt view RUN --sae SAE`) read on the
viewed run, as JSON-ready values.

Every number comes from glassgpt.interp.sae.features (the latents spliced with the error term,
the scan of the run's text, a feature's logit effects and writers, the clamp's hooks, run at
every decoding step); this module parses the requests and shapes the answers.
    top features   the k largest latents at each position of a prompt
    a feature      its top-activating windows of the run's validation text (a bounded scan, done
                   once per dictionary), its density (the dictionary's sparsity file, else the
                   scan), the tokens its decoder row pushes up and down through the unembedding,
                   and each head's and MLP's direct push on its pre-activation at a position
    clamp          a continuation with the feature set to a value (or scaled) at every position,
                   beside the untouched one from the same seed
Notation: T = prompt tokens, F = d_sae (latents), C = width, V = vocabulary, N = scanned windows.
"""

from __future__ import annotations

import dataclasses
import math
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from glassgpt.config import SamplingConfig
from glassgpt.decoding.generate import generate
from glassgpt.errors import GlassGPTError, InputError, ModelError
from glassgpt.interp.core import checks
from glassgpt.interp.core.hooked import hook_points
from glassgpt.interp.graph.layers import decoder_norms
from glassgpt.interp.sae import SAE
from glassgpt.interp.sae.crosslayer import CrossLayerTranscoder
from glassgpt.interp.sae.features import (
    Scan,
    clamp_hooks,
    feature_writers,
    latents,
    logit_effects,
    scan_text,
    top_contexts,
    writers_unavailable,
)
from glassgpt.interp.sae.splice import check_saes
from glassgpt.view.values import View, rounded

TOP_PER_POSITION = 5  # features listed under each token
MAX_K = 20
TOP_CONTEXTS = 8
LOGIT_TOKENS = 10  # tokens listed pushed up, and down
MAX_CLAMP_TOKENS = 200  # new tokens, each continuation
CLAMP_NEW_TOKENS = 40  # the panel's default: two continuations side by side, read at once
# A latent is a length along its decoder row (unit norm in SAELens's dictionaries): trained
# ones fire at up to tens, steering asks for ten times that, and residual streams are at most
# thousands long, so a latent set past 10,000 or scaled past 1,000 only shows an overflow.
MAX_CLAMP_VALUE, MAX_CLAMP_SCALE = 1e4, 1e3


class Dictionaries:
    """The dictionaries the view was started with, by name, each checked against the model."""

    def __init__(self, view: View, saes: dict[str, SAE]):
        self.view, self.saes = view, saes
        self.scans: dict[str, Scan | None] = {}
        # a dictionary that is a layer of a cross-layer transcoder: the CLT and the layer
        self.crosslayer: dict[str, tuple[CrossLayerTranscoder, int]] = {}

    def add(self, name: str, sae: SAE, crosslayer: tuple[CrossLayerTranscoder, int] | None = None
            ) -> str:
        """Add `sae` under `name` (primed until it is new); the name it got."""
        while name in self.saes:
            name += "'"
        self.saes[name] = sae
        if crosslayer is not None:
            self.crosslayer[name] = crosslayer
        return name

    def listing(self) -> list[dict[str, Any]]:
        return [{"name": name, "hook": sae.cfg.hook_name_out, "reads": sae.cfg.hook_name,
                 "architecture": sae.cfg.architecture, "d_sae": sae.cfg.d_sae}
                for name, sae in self.saes.items()]

    def get(self, name: str | None) -> tuple[str, SAE]:
        """The dictionary `name` (None: the first)."""
        if not self.saes:
            raise InputError("this view has no dictionaries: start it with glassgpt view RUN "
                             "--sae SAE")
        if name is None:
            name = next(iter(self.saes))
        if name not in self.saes:
            raise InputError(f"no dictionary {name[:60]!r}; this view has "
                             f"{', '.join(self.saes)}")
        return name, self.saes[name]

    def scan(self, name: str) -> Scan | None:
        """The scan of `name`'s dictionary over the validation text (once; None: no text)."""
        if name not in self.scans:
            self.scans[name] = scan_text(self.view.model, self.saes[name],
                                         validation_ids(self.view))
        return self.scans[name]


def validation_ids(view: View) -> np.ndarray | None:
    reader = getattr(view, "validation_ids", None)  # a RunView's; a bare View has no text
    return reader() if reader is not None else None


def load_dictionaries(view: View, paths: list[str | Path]) -> Dictionaries:
    """The dictionaries at `paths`, each refused by name (one line) unless it fits the viewed
    model: its hook points exist and its widths are theirs. Named by their folder."""
    saes: dict[str, SAE] = {}
    for path in paths:
        sae = SAE.load(path, device=view.model.lm_head.weight.device)
        probe = torch.zeros(1, 1, dtype=torch.long, device=sae.W_enc.device)
        try:
            check_saes(view.model, probe, [sae], hook_points(view.model))
        except GlassGPTError as error:
            raise InputError(f"--sae {path}: {error}") from None
        name = Path(path).name or "sae"
        while name in saes:
            name += "'"
        saes[name] = sae
    return Dictionaries(view, saes)


# --- top features of a prompt --------------------------------------------------------------------

def top_features(view: View, dicts: Dictionaries, prompt: str, sae: str | None = None,
                 k: int = TOP_PER_POSITION) -> dict[str, Any]:
    """The k largest latents (id, value) at each position of `prompt` (only those above 0)."""
    if not 1 <= checks.integer("k", k) <= MAX_K:
        raise InputError(f"k must be between 1 and {MAX_K}, got {k}")
    name, chosen = dicts.get(sae)
    encoded = view.encode(prompt)
    acts = latents(view.model, chosen, encoded.idx)[0]  # (T, F)
    values, ids = torch.topk(acts, min(k, acts.shape[-1]), dim=-1)  # (T, k)
    positions = [[{"id": int(i), "value": v} for i, v in zip(row_ids, row_values, strict=True)
                  if v > 0] for row_ids, row_values in zip(ids.tolist(), rounded(values),
                                                           strict=True)]
    return {"sae": name, "hook": chosen.cfg.hook_name_out, "d_sae": chosen.cfg.d_sae,
            "tokens": [{"id": i, "text": view.token_text(i)} for i in encoded.ids],
            "positions": positions}


# --- one feature ---------------------------------------------------------------------------------

def feature(view: View, dicts: Dictionaries, sae: str, feature: int,
            prompt: str | None = None, position: int | None = None) -> dict[str, Any]:
    """A feature's page: top contexts, density, logit effects and, given a prompt and a position,
    each head's and MLP's direct push on its pre-activation there."""
    name, chosen = dicts.get(sae)
    checks.index("feature", feature, chosen.cfg.d_sae)
    if position is not None and prompt is None:
        raise InputError("a position is a position of the prompt: give the prompt too")
    scan = dicts.scan(name)
    scanned = None if scan is None else {"windows": scan.windows.shape[0],
                                         "tokens": scan.positions}
    answer = {"sae": name, "feature": feature, "hook": chosen.cfg.hook_name_out,
              "contexts": contexts(view, chosen, scan, feature), "scanned": scanned,
              "density": density(chosen, scan, feature),
              "logits": logit_effects_listed(view, chosen, feature)}
    if name in dicts.crosslayer:  # a CLT's feature: every later MLP output it writes into
        answer["writes_to"] = decoder_norms(*dicts.crosslayer[name], feature)
    why_not = writers_unavailable(view.model, chosen)
    if why_not is not None:
        answer["writers_note"] = why_not
    elif prompt is not None:
        if position is None:
            raise InputError("give the position whose writers to show with the prompt")
        answer["writers"] = writers(view, chosen, feature, prompt, position)
    return answer


def contexts(view: View, sae: SAE, scan: Scan | None, feature: int) -> list[dict[str, Any]]:
    """The TOP_CONTEXTS scanned windows where the feature is largest, each token with its
    activation (the page shades by it)."""
    windows, acts = top_contexts(view.model, sae, scan, feature, TOP_CONTEXTS)  # (n, W) each
    return [{"max": rounded(acts[row].max()), "tokens": [
                {"id": int(t), "text": view.token_text(int(t)), "value": v}
                for t, v in zip(windows[row].tolist(), rounded(acts[row]), strict=True)]}
            for row in range(windows.shape[0])]


def density(sae: SAE, scan: Scan | None, feature: int) -> dict[str, Any] | None:
    """How often the feature fires: from the dictionary's sparsity file when it has one
    (SAELens's log10 frequency over its training tokens), else from the scan."""
    if sae.log_sparsity is not None:
        return {"value": float(10 ** sae.log_sparsity[feature].double()),
                "source": "the dictionary's sparsity file"}
    if scan is None:
        return None
    return {"value": int(scan.fired[feature]) / scan.positions,
            "source": f"{scan.positions:,} tokens of the run's validation text"}


def logit_effects_listed(view: View, sae: SAE, feature: int) -> dict[str, Any] | None:
    """The tokens the feature's decoder row pushes up and down most (`logit_effects`); None for
    a dictionary that writes elsewhere than the residual width."""
    effects = logit_effects(view.model, sae, feature)  # (V,)
    if effects is None:
        return None
    effects = effects[:view.tokenizer.vocab_size]
    count = min(LOGIT_TOKENS, effects.shape[0])

    def listed(values: Tensor, ids: Tensor) -> list[dict[str, Any]]:
        return [{"id": int(i), "text": view.token_text(int(i)), "value": v}
                for i, v in zip(ids.tolist(), rounded(values), strict=True)]
    return {"up": listed(*torch.topk(effects, count)),
            "down": listed(*torch.topk(effects, count, largest=False))}


def writers(view: View, sae: SAE, feature: int, prompt: str, position: int) -> dict[str, Any]:
    """Each part's push on the feature's pre-activation at `position` of `prompt`
    (`feature_writers`), the largest first in `order`, adding up to `pre`."""
    found = feature_writers(view.model, sae, feature, view.encode(prompt).idx, position)
    order = sorted(range(len(found.values)), key=lambda i: -abs(found.values[i]))
    return {"position": position, "labels": found.labels, "values": found.values,
            "order": order, "constant": found.constant, "sum": found.total, "pre": found.pre,
            "post": found.post}


# --- clamping a feature while sampling -----------------------------------------------------------

def clamp(view: View, dicts: Dictionaries, sae: str, feature: int, prompt: str,
          sampling: SamplingConfig, value: float | None = None, scale: float | None = None
          ) -> dict[str, Any]:
    """The continuation of `prompt` with the feature clamped, beside the untouched one: both
    drawn with the same settings and seed (one is chosen when `sampling` has none)."""
    name, chosen = dicts.get(sae)
    checks.index("feature", feature, chosen.cfg.d_sae)
    if (value is None) == (scale is None):
        raise InputError("give one of value (set the feature to it) or scale (multiply it)")
    if value is not None:
        check_clamp_number("value", value, MAX_CLAMP_VALUE)
    else:
        check_clamp_number("scale", scale, MAX_CLAMP_SCALE)
    if sampling.max_new_tokens > MAX_CLAMP_TOKENS:
        raise InputError(f"max_new_tokens must be at most {MAX_CLAMP_TOKENS} here, got "
                         f"{sampling.max_new_tokens}")
    encoded = view.encode(prompt)
    if sampling.seed is None:
        sampling = dataclasses.replace(sampling, seed=random.randrange(2**31))
    untouched = generate(view.model, encoded.idx, sampling)[0, len(encoded.ids):]
    try:
        clamped = generate(view.model, encoded.idx, sampling,
                           hooks=clamp_hooks(chosen, feature, value, scale))[0, len(encoded.ids):]
    except ModelError:  # the untouched run was finite: the clamp overflowed it
        edit = f"value={value}" if value is not None else f"scale={scale}"
        raise InputError(f"the clamp ({edit}) drives the model's logits past its float "
                         f"range (the same prompt untouched does not): choose a smaller "
                         f"{edit.partition('=')[0]}") from None
    return {"sae": name, "feature": feature, "value": value, "scale": scale,
            "seed": sampling.seed, "untouched": _continuation(view, untouched),
            "clamped": _continuation(view, clamped)}


def check_clamp_number(name: str, number: float, largest: float) -> None:
    """InputError unless `number` (a JSON number: an int may have hundreds of digits) is
    finite and within +-`largest`; the message names it."""
    if isinstance(number, float) and not math.isfinite(number):
        raise InputError(f"{name}={number} is not a finite number; a clamp's {name} is a "
                         f"number within +-{largest:,.0f}")
    if abs(number) > largest:
        text = f"{number:g}" if isinstance(number, float) else str(number)
        shown = text if len(text) <= 16 else f"{text[:8]}... ({len(text)} digits)"
        raise InputError(f"{name}={shown} is out of range: a clamp's {name} is within "
                         f"+-{largest:,.0f} (beyond that the model only overflows)")


def _continuation(view: View, ids: Tensor) -> dict[str, Any]:
    ids = ids.tolist()
    return {"text": view.tokenizer.decode(ids), "ids": ids}
