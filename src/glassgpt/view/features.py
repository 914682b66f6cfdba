"""The Features panel's numbers: sparse dictionaries (`glassgpt view RUN --sae SAE`) read on the
viewed run, as JSON-ready values.

Every activation comes from glassgpt.interp: the latents from `run_with_cache_and_saes` (with
the error term, so the model downstream computes what it always does), a feature's writers from
`attribution.residual_parts`, a clamp from interp.sae's own splice run at every decoding step.
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
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from glassgpt.config import SamplingConfig
from glassgpt.decoding.generate import generate
from glassgpt.errors import GlassGPTError, InputError, ModelError
from glassgpt.interp import checks
from glassgpt.interp.attribution import check_sum_of_parts, frozen_norm, norm_gain, residual_parts
from glassgpt.interp.hooked import hook_points
from glassgpt.interp.sae import SAE, run_with_cache_and_saes
from glassgpt.interp.sae.splice import check_saes, splice_hooks
from glassgpt.view.values import View, rounded

TOP_PER_POSITION = 5  # features listed under each token
MAX_K = 20
SCAN_WINDOWS = 64  # windows of the validation text scanned for a feature's top contexts
SCAN_TOKENS = 32  # tokens a scanned window holds (at most the model's context)
SCAN_BATCH = 16  # windows run at once
TOP_CONTEXTS = 8
LOGIT_TOKENS = 10  # tokens listed pushed up, and down
MAX_CLAMP_TOKENS = 200  # new tokens, each continuation
CLAMP_NEW_TOKENS = 40  # the panel's default: two continuations side by side, read at once
# A latent is a length along its decoder row (unit norm in SAELens's dictionaries): trained
# ones fire at up to tens, steering asks for ten times that, and residual streams are at most
# thousands long, so a latent set past 10,000 or scaled past 1,000 only shows an overflow.
MAX_CLAMP_VALUE, MAX_CLAMP_SCALE = 1e4, 1e3
RESIDUAL_POINT = re.compile(r"blocks\.(\d+)\.hook_resid_(pre|mid|post)")
PART_LAYER = re.compile(r"L(\d+)(H\d+| attn| MLP)")


@dataclass
class Scan:
    """What the scan of the validation text found for every latent at once."""

    windows: Tensor  # (N, W) token ids
    best: Tensor  # (N, F): each window's largest activation of each latent
    fired: Tensor  # (F,): positions where each latent was above 0
    positions: int  # N * W


class Dictionaries:
    """The dictionaries the view was started with, by name, each checked against the model."""

    def __init__(self, view: View, saes: dict[str, SAE]):
        self.view, self.saes = view, saes
        self.scans: dict[str, Scan | None] = {}

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
            self.scans[name] = scan_text(self.view, self.saes[name], validation_ids(self.view))
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


def latents(view: View, sae: SAE, idx: Tensor) -> Tensor:
    """The dictionary's latents (B, T, F) on ids idx (B, T), spliced with its error term."""
    name = f"{sae.cfg.hook_name_out}.hook_sae_acts_post"
    _, cache = run_with_cache_and_saes(view.model, idx, [sae], use_error_term=True, names=[name])
    return cache[name].float()


# --- top features of a prompt --------------------------------------------------------------------

def top_features(view: View, dicts: Dictionaries, prompt: str, sae: str | None = None,
                 k: int = TOP_PER_POSITION) -> dict[str, Any]:
    """The k largest latents (id, value) at each position of `prompt` (only those above 0)."""
    if not 1 <= checks.integer("k", k) <= MAX_K:
        raise InputError(f"k must be between 1 and {MAX_K}, got {k}")
    name, chosen = dicts.get(sae)
    encoded = view.encode(prompt)
    acts = latents(view, chosen, encoded.idx)[0]  # (T, F)
    values, ids = torch.topk(acts, min(k, acts.shape[-1]), dim=-1)  # (T, k)
    positions = [[{"id": int(i), "value": v} for i, v in zip(row_ids, row_values, strict=True)
                  if v > 0] for row_ids, row_values in zip(ids.tolist(), rounded(values),
                                                           strict=True)]
    return {"sae": name, "hook": chosen.cfg.hook_name_out, "d_sae": chosen.cfg.d_sae,
            "tokens": [{"id": i, "text": view.token_text(i)} for i in encoded.ids],
            "positions": positions}


# --- one feature ---------------------------------------------------------------------------------

def scan_text(view: View, sae: SAE, text: np.ndarray | None) -> Scan | None:
    """Every latent's largest activation in each of SCAN_WINDOWS windows spread evenly through
    `text`, and how often each fired; None when the text is shorter than one window."""
    width = min(SCAN_TOKENS, view.model.config.block_size)
    if text is None or len(text) < width:
        return None
    starts = dict.fromkeys(np.linspace(0, len(text) - width, SCAN_WINDOWS).astype(int).tolist())
    windows = torch.stack([torch.as_tensor(np.asarray(text[s:s + width], dtype=np.int64))
                           for s in starts]).to(sae.W_enc.device)  # (N, W)
    best, fired = [], torch.zeros(sae.cfg.d_sae, dtype=torch.long, device=windows.device)
    for batch in windows.split(SCAN_BATCH):
        acts = latents(view, sae, batch)  # (n, W, F)
        best.append(acts.amax(dim=1))  # (n, F)
        fired += (acts > 0).sum(dim=(0, 1))
    return Scan(windows, torch.cat(best), fired, windows.numel())


def feature(view: View, dicts: Dictionaries, sae: str, feature: int,
            prompt: str | None = None, position: int | None = None) -> dict[str, Any]:
    """A feature's page: top contexts, density, logit effects and, given a prompt and a position,
    each head's and MLP's direct push on its pre-activation there."""
    name, chosen = dicts.get(sae)
    checks.index("feature", feature, chosen.cfg.d_sae)
    scan = dicts.scan(name)
    scanned = None if scan is None else {"windows": scan.windows.shape[0],
                                         "tokens": scan.positions}
    answer = {"sae": name, "feature": feature, "hook": chosen.cfg.hook_name_out,
              "contexts": contexts(view, chosen, scan, feature), "scanned": scanned,
              "density": density(chosen, scan, feature),
              "logits": logit_effects(view, chosen, feature)}
    why_not = writers_unavailable(view, chosen)
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
    if scan is None:
        return []
    peaks = scan.best[:, feature]  # (N,)
    order = [i for i in torch.argsort(peaks, descending=True)[:TOP_CONTEXTS].tolist()
             if peaks[i] > 0]
    if not order:
        return []
    windows = scan.windows[order]  # (n, W)
    acts = latents(view, sae, windows)[..., feature]  # (n, W)
    return [{"max": rounded(acts[row].max()), "tokens": [
                {"id": int(t), "text": view.token_text(int(t)), "value": v}
                for t, v in zip(windows[row].tolist(), rounded(acts[row]), strict=True)]}
            for row in range(len(order))]


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


def logit_effects(view: View, sae: SAE, feature: int) -> dict[str, Any] | None:
    """The tokens the feature's decoder row W_dec[f] pushes up and down through the unembedding,
    after the final norm's gain (and its centring, for a LayerNorm), as the Attribution panel
    reads a direction. None for a dictionary that writes elsewhere than the residual width."""
    model = view.model
    direction = sae.W_dec[feature].detach().double()  # (C,)
    if direction.shape[-1] != model.config.n_embd:
        return None
    _, centred = frozen_norm(model.ln_f, direction[None])
    if centred:
        direction = direction - direction.mean()
    direction = direction * norm_gain(model.ln_f).detach().double()
    effects = model.lm_head.weight.detach().double() @ direction  # (V,)
    effects = effects[:view.tokenizer.vocab_size]
    count = min(LOGIT_TOKENS, effects.shape[0])

    def listed(values: Tensor, ids: Tensor) -> list[dict[str, Any]]:
        return [{"id": int(i), "text": view.token_text(int(i)), "value": v}
                for i, v in zip(ids.tolist(), rounded(values), strict=True)]
    return {"up": listed(*torch.topk(effects, count)),
            "down": listed(*torch.topk(effects, count, largest=False))}


def writers_unavailable(view: View, sae: SAE) -> str | None:
    """Why a feature's writers cannot be read for this dictionary and model, or None."""
    point = RESIDUAL_POINT.fullmatch(sae.cfg.hook_name or "")
    if point is None or sae.cfg.reshape_activations != "none":
        return (f"writers are read for a dictionary on the residual stream "
                f"(blocks.L.hook_resid_pre/mid/post); this one reads {sae.cfg.hook_name}")
    try:
        check_sum_of_parts(view.model)
    except ModelError as error:
        return str(error)
    return None


def writers(view: View, sae: SAE, feature: int, prompt: str, position: int) -> dict[str, Any]:
    """Each head's, MLP's and embedding's direct push on the feature's pre-activation at
    `position`: the parts of the residual stream the dictionary reads (`residual_parts`), each
    times its encoder column, and the constant b_enc[f] - b_dec . W_enc[:, f]; they add up to
    the pre-activation (`pre`, from the spliced run's hook_sae_acts_pre)."""
    why_not = writers_unavailable(view, sae)
    if why_not is not None:
        raise InputError(why_not)
    encoded = view.encode(prompt)
    checks.index("position", position, len(encoded.ids))
    _, cache = run_with_cache_and_saes(view.model, encoded.idx, [sae], use_error_term=True)
    labels, parts = residual_parts(view.model, cache, position)
    point = RESIDUAL_POINT.fullmatch(sae.cfg.hook_name)
    layer, where = int(point.group(1)), point.group(2)
    kept = [i for i, label in enumerate(labels) if _reaches(label, layer, where)]
    column = sae.W_enc[:, feature].detach().double()  # (C,)
    values = [float(parts[i][0].detach().double() @ column) for i in kept]
    constant = float(sae.b_enc[feature].detach().double())
    if sae.cfg.apply_b_dec_to_input:
        constant -= float(sae.b_dec.detach().double() @ column)
    at = f"{sae.cfg.hook_name_out}.hook_sae_acts_"
    order = sorted(range(len(kept)), key=lambda i: -abs(values[i]))
    return {"position": position, "labels": [labels[i] for i in kept], "values": values,
            "order": order, "constant": constant, "sum": sum(values) + constant,
            "pre": float(cache[at + "pre"][0, position, feature]),
            "post": float(cache[at + "post"][0, position, feature])}


def _reaches(label: str, layer: int, where: str) -> bool:
    """Whether the part `label` is in the stream at blocks.{layer}.hook_resid_{where}."""
    found = PART_LAYER.match(label)
    if found is None:  # the embeddings
        return True
    part_layer = int(found.group(1))
    if part_layer != layer:
        return part_layer < layer
    return where == "post" or (where == "mid" and found.group(2) != " MLP")


# --- clamping a feature while sampling -----------------------------------------------------------

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
