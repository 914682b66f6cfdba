"""What replaces the MLPs of an attribution graph, as the graph reads it a layer at a time: a
transcoder of the layer (SAELens's format, glassgpt.interp.sae.model.SAE), or layer l of a
cross-layer transcoder (glassgpt.interp.sae.crosslayer), whose features write into the MLP
outputs of layer l and of every later layer.

Of layer l the graph reads where its encoder reads (`cfg.hook_name`) and the point it
reconstructs (`cfg.hook_name_out`), its encoder W_enc (d_in, d) and b_enc (d,), its features
(`encode`), a feature's pre-activation (`feature_pre_acts`) and what its active features write,
into which layers (`feature_writes`). The MLP outputs the replacement computes are
`reconstruction`'s: each transcoder's own decoding, or for a CLT the sum over the layers at or
below each one (circuit-tracer's reconstruction, the CLT's decode), so the error node of layer
t is the MLP output of t minus what every feature of layers 0..t writes there. A feature's edge
to a target then sums what it writes into each layer it reaches, dotted with the gradient there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from glassgpt.errors import InputError
from glassgpt.hooknames import parse_hook_name
from glassgpt.interp.sae.crosslayer import CrossLayerTranscoder
from glassgpt.interp.sae.encoding import pre_acts
from glassgpt.interp.sae.model import SAE

# Where a transcoder of layer L may read: the MLP's input, before or after its norm.
READS = ("ln2.hook_normalized", "hook_mlp_in", "hook_resid_mid")


@dataclass(frozen=True)
class LayerPoints:
    """Where layer l of a CLT reads and writes, and its width: what the graph reads of a
    transcoder's cfg."""

    hook_name: str
    hook_name_out: str
    d_sae: int


class CLTLayer:
    """Layer `layer` of a cross-layer transcoder, seen as the graph sees a transcoder: W_enc
    (d_model, d_tc), b_enc (d_tc,), `encode`, and decoders into layers layer..L-1."""

    def __init__(self, clt: CrossLayerTranscoder, layer: int):
        self.clt, self.layer = clt, layer
        self.cfg = LayerPoints(clt.input_hook_at(layer), clt.output_hook_at(layer),
                               clt.d_transcoder)

    @property
    def W_enc(self) -> Tensor:  # noqa: N802 (the transcoder's name for it)
        return self.clt.W_enc[self.layer]

    @property
    def b_enc(self) -> Tensor:
        return self.clt.b_enc[self.layer]

    def encode(self, x: Tensor) -> Tensor:
        """x (..., d_model) -> the layer's features (..., d_tc)."""
        return self.clt.encode_layer(x, self.layer)


Replacer = SAE | CLTLayer


def clt_layers(model: nn.Module, clt: CrossLayerTranscoder) -> list[CLTLayer]:
    """The CLT's layers, refused by name unless it replaces the model's MLPs: as many layers,
    the model's width and device, each layer reading its MLP's input (READS) and writing its
    blocks.L.hook_mlp_out."""
    config = model.config
    if config.attn_only:
        raise InputError("this model has no MLPs: its graph needs no transcoders")
    if (clt.n_layers, clt.d_model) != (config.n_layer, config.n_embd):
        raise InputError(f"the cross-layer transcoder spans {clt.n_layers} layers of width "
                         f"{clt.d_model}; this model has {config.n_layer} of width "
                         f"{config.n_embd}")
    for layer in range(clt.n_layers):
        reads, writes = clt.input_hook_at(layer), clt.output_hook_at(layer)
        if reads not in {f"blocks.{layer}.{point}" for point in READS}:
            raise InputError(f"the cross-layer transcoder reads {reads} at layer {layer}; it "
                             f"must read that block's MLP input: "
                             f"{', '.join(f'blocks.{layer}.{p}' for p in READS)}")
        if writes != f"blocks.{layer}.hook_mlp_out":
            raise InputError(f"the cross-layer transcoder writes {writes} at layer {layer}; an "
                             f"attribution graph's writes blocks.{layer}.hook_mlp_out")
    device = model.lm_head.weight.device
    if clt.W_enc.device != device:
        raise InputError(f"the cross-layer transcoder is on {clt.W_enc.device}, the model on "
                         f"{device}: move one to the other")
    return [CLTLayer(clt, layer) for layer in range(clt.n_layers)]


def is_clt(layers: Sequence[Replacer | None]) -> bool:
    return bool(layers) and isinstance(layers[0], CLTLayer)


def feature_pre_acts(replacer: Replacer, x: Tensor, features: Tensor) -> Tensor:
    """x (N, d_in), features (N,) -> row n's pre-activation of feature features[n] (N,), from
    that column of W_enc alone."""
    if isinstance(replacer, SAE):
        return pre_acts(replacer, x, features)
    return (x * replacer.W_enc[:, features].T).sum(-1) + replacer.b_enc[features]


def feature_writes(replacer: Replacer, layer: int, ids: Tensor, values: Tensor
                   ) -> list[tuple[int, Tensor]]:
    """What the features `ids` (n,) of `layer` with activations `values` (n,) write: (the
    layer whose MLP output it goes into, the vectors (n, C)), one layer for a transcoder,
    layer..L-1 for a CLT."""
    if isinstance(replacer, SAE):
        return [(layer, replacer.W_dec[ids] * values[:, None].to(replacer.W_dec.dtype))]
    rows = replacer.clt.decoder_rows(layer)[ids]  # (n, L - layer, C)
    rows = rows * values[:, None, None].to(rows.dtype)
    return [(layer + offset, rows[:, offset]) for offset in range(rows.shape[1])]


def reconstruction(layers: Sequence[Replacer | None], acts: Sequence[Tensor | None],
                   like: Tensor) -> Tensor:
    """Every MLP output the transcoders reconstruct from the features `acts` ((T, d) a
    layer), (L, T, C) in `like`'s dtype (zero where a layer has no transcoder)."""
    if is_clt(layers):
        clt = layers[0].clt
        return clt.decode(torch.stack(list(acts))).to(like.dtype)  # (L, T, C)
    out = torch.zeros_like(like)
    for layer, sae in enumerate(layers):
        if sae is not None:
            out[layer] = sae.decode(acts[layer]).to(like.dtype)
    return out


def check_writes_mlp_out(sae: SAE, n_layer: int) -> int:
    """The layer whose MLP output a transcoder writes (blocks.L.hook_mlp_out), or InputError."""
    writes = parse_hook_name(sae.cfg.hook_name_out or "")
    if writes.layer not in range(n_layer) or writes.module or writes.point != "hook_mlp_out":
        raise InputError(f"a transcoder of the graph writes blocks.L.hook_mlp_out (L < "
                         f"{n_layer}); this one writes {sae.cfg.hook_name_out}")
    return writes.layer


def as_transcoder(clt: CrossLayerTranscoder, layer: int) -> SAE | None:
    """Layer `layer` of the CLT as a transcoder of its own layer (its encoder, and the decoder
    into its own MLP output alone): what the view's Features panel reads a feature's contexts,
    density, logit effects and writers from. A copy; None for a TopK CLT, whose features no
    transcoder architecture computes."""
    from glassgpt.interp.sae.config import SAEConfig

    if clt.activation == "topk":
        return None
    W_enc = clt.W_enc[layer].detach()
    dtype = str(W_enc.dtype).removeprefix("torch.")
    cfg = SAEConfig(d_in=clt.d_model, d_sae=clt.d_transcoder, d_out=clt.d_model,
                    architecture="jumprelu_transcoder" if clt.activation == "jumprelu"
                    else "transcoder", dtype=dtype, device=str(W_enc.device),
                    apply_b_dec_to_input=False,
                    metadata={**clt.metadata, "hook_name": clt.input_hook_at(layer),
                              "hook_name_out": clt.output_hook_at(layer)})
    sae = SAE(cfg)
    with torch.no_grad():
        sae.W_enc.copy_(W_enc)
        sae.b_enc.copy_(clt.b_enc[layer])
        sae.W_dec.copy_(clt.decoder_rows(layer)[:, 0])  # (d_tc, C): into its own layer
        sae.b_dec.copy_(clt.b_dec[layer])
        if clt.threshold is not None:
            sae.threshold.copy_(clt.threshold[layer])
    return sae


def decoder_norms(clt: CrossLayerTranscoder, layer: int, feature: int) -> list[dict[str, float]]:
    """Which MLP outputs feature `feature` of `layer` writes into, and how strongly: the norm
    of its decoder row into each layer from `layer` on."""
    norms = clt.decoder_rows(layer)[feature].detach().norm(dim=-1)  # (L - layer,)
    return [{"layer": layer + offset, "norm": float(norm)} for offset, norm in
            enumerate(norms.tolist())]
