"""How good a cross-layer transcoder is, in SAELens's terms (glassgpt.interp.sae.metrics) taken
layer by layer, and the spliced cross-entropy with every MLP replaced at once.

Over N positions of held-out windows, x_l at each layer's input point and y_l at its output
point (`clt.input_hook_at(l)`, `clt.output_hook_at(l)`), f = clt.encode(x), y_hat =
clt.decode(f):

    l0[l], explained_variance[l]   SAELens's, of layer l's features and reconstruction
    mse                            sum over layers of the mean sum_d (y - y_hat)^2
    dead                           features (of L * d_tc) that fire on no position
and over the next-token predictions of the same windows:

    ce_loss_spliced       every layer's output point replaced by the CLT's reconstruction,
                          each encoder reading the spliced model's own input at its layer
    ce_loss_zero_ablated  every layer's output point set to zero
    ce_loss_recovered     (ce_zero_ablated - ce_spliced) / (ce_zero_ablated - ce_clean)
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from glassgpt.errors import InputError
from glassgpt.interp.core.hooked import run_with_cache, run_with_hooks
from glassgpt.interp.sae.crosslayer import CrossLayerTranscoder
from glassgpt.interp.sae.metrics import ReconstructionMeter


@dataclass(frozen=True)
class CrossLayerMetrics:
    l0: list[float]  # per layer
    explained_variance: list[float]  # per layer
    mse: float
    dead: int
    features: int
    tokens: int
    ce_loss_clean: float
    ce_loss_spliced: float
    ce_loss_zero_ablated: float

    @property
    def ce_loss_recovered(self) -> float:
        gap = self.ce_loss_zero_ablated - self.ce_loss_clean
        return math.nan if gap == 0 else (self.ce_loss_zero_ablated - self.ce_loss_spliced) / gap

    def summary(self) -> dict[str, Any]:
        return {"l0": self.l0, "explained_variance": self.explained_variance, "mse": self.mse,
                "ce_loss_clean": self.ce_loss_clean, "ce_loss_spliced": self.ce_loss_spliced,
                "ce_loss_zero_ablated": self.ce_loss_zero_ablated,
                "ce_loss_recovered": self.ce_loss_recovered, "dead": self.dead,
                "features": self.features, "tokens": self.tokens}


def layer_activations(model: nn.Module, clt: CrossLayerTranscoder, ids: Tensor
                      ) -> tuple[Tensor, Tensor]:
    """ids (B, T) -> (x, y), each (L, B*T, d): every layer's input and output point."""
    inputs = [clt.input_hook_at(layer) for layer in range(clt.n_layers)]
    outputs = [clt.output_hook_at(layer) for layer in range(clt.n_layers)]
    _, cache = run_with_cache(model, ids, inputs + outputs)
    x = torch.stack([cache[name].flatten(0, -2) for name in inputs])
    return x, torch.stack([cache[name].flatten(0, -2) for name in outputs])


def spliced_logits(model: nn.Module, clt: CrossLayerTranscoder, ids: Tensor) -> Tensor:
    """ids (B, T) -> logits (B, T, V) with every layer's output point replaced by the CLT's
    reconstruction; layer l's encoder reads the spliced model's input at l (computed from the
    replaced outputs of the layers before it)."""
    reads = {clt.input_hook_at(layer): layer for layer in range(clt.n_layers)}
    writes = {clt.output_hook_at(layer): layer for layer in range(clt.n_layers)}
    features: dict[int, Tensor] = {}  # layer -> f (B, T, d_tc), as the model reaches it

    def encode(activation: Tensor, name: str) -> None:
        features[reads[name]] = clt.encode_layer(activation, reads[name])

    def replace(activation: Tensor, name: str) -> Tensor:
        target = writes[name]  # every layer up to it has been read: its input comes first
        out = clt.b_dec[target].expand_as(activation)
        for source in range(target + 1):
            out = out + features[source] @ clt.W_dec[source][:, target - source]
        return out.to(activation.dtype)

    hooks = [(name, encode) for name in reads] + [(name, replace) for name in writes]
    return run_with_hooks(model, ids, hooks)


def evaluate_crosslayer(model: nn.Module, clt: CrossLayerTranscoder,
                        batches: Iterable[tuple[Tensor, Tensor]]) -> CrossLayerMetrics:
    """The metrics of the module docstring over windows (x, y) (B, T) of token ids, y the next
    tokens of x."""
    meters = [ReconstructionMeter(clt.d_transcoder) for _ in range(clt.n_layers)]
    fired = torch.zeros(clt.n_layers, clt.d_transcoder, dtype=torch.long)
    totals, predicted = torch.zeros(3, dtype=torch.float64), 0
    outputs = [clt.output_hook_at(layer) for layer in range(clt.n_layers)]

    def zero(activation: Tensor, name: str) -> Tensor:
        return torch.zeros_like(activation)

    def ce(logits: Tensor, targets: Tensor) -> float:
        return float(F.cross_entropy(logits.flatten(0, 1).double(), targets.flatten()))

    with torch.no_grad():
        for x_ids, y_ids in batches:
            x, y = layer_activations(model, clt, x_ids)
            f = clt.encode(x)
            y_hat = clt.decode(f)
            for layer, meter in enumerate(meters):
                meter.add(y[layer], f[layer], y_hat[layer])
            fired += (f != 0).sum(1).cpu()
            n = y_ids.numel()
            totals += n * torch.tensor([
                ce(run_with_hooks(model, x_ids), y_ids),
                ce(spliced_logits(model, clt, x_ids), y_ids),
                ce(run_with_hooks(model, x_ids, [(name, zero) for name in outputs]), y_ids)],
                dtype=torch.float64)
            predicted += n
    if predicted == 0:
        raise InputError("evaluate_crosslayer needs at least one batch of windows")
    results = [meter.result() for meter in meters]
    clean, spliced, ablated = (totals / predicted).tolist()
    return CrossLayerMetrics(
        l0=[r.l0 for r in results], explained_variance=[r.explained_variance for r in results],
        mse=sum(r.mse for r in results), dead=int((fired == 0).sum()), features=fired.numel(),
        tokens=results[0].tokens, ce_loss_clean=clean, ce_loss_spliced=spliced,
        ce_loss_zero_ablated=ablated)
