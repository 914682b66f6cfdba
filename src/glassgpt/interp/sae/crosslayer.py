"""`CrossLayerTranscoder`: one encoder per layer reading that layer's MLP input, and decoders
from each layer's features into the MLP outputs of that layer and every later one (Anthropic's
"Circuit Tracing", 2025; circuit-tracer 0.5's `CrossLayerTranscoder` computes the same numbers,
which tests/test_crosslayer.py checks on its own weights).

Notation: L layers, x_l (..., d_model) the MLP input of layer l (`input_hook` at l), f_l
(..., d_tc) layer l's features, y_t (..., d_model) the reconstruction of layer t's MLP output
(`output_hook` at t).

    pre_l = x_l @ W_enc[l] + b_enc[l]                                    W_enc (L, d_model, d_tc)
    f_l   = pre_l * [pre_l > threshold[l]]     "jumprelu" (threshold (L, d_tc); z H(z - theta))
          = ReLU(pre_l)                        "relu"
          = ReLU of the k largest of pre_l, 0 elsewhere                  "topk" (k per layer)
    y_t   = sum over l <= t of f_l @ W_dec[l][:, t - l] + b_dec[t]       W_dec[l] (d_tc, L - l,
                                                                         d_model), b_dec (L, d)

Layer l's decoder holds L - l rows per feature: feature i of layer l writes W_dec[l][i, t - l]
into layer t's MLP output. Each layer's features are its own (d_tc of them), so a CLT has
L * d_tc features in all.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from glassgpt.errors import ConfigError, InputError

ACTIVATIONS = ("jumprelu", "relu", "topk")
# Where a CLT reads and writes, "{L}" standing for the layer: glassgpt's transcoders read the
# normalised MLP input (x_hat, before the norm's gain), as circuit-tracer's GPT-2-like graphs do.
DEFAULT_INPUT_HOOK = "blocks.{L}.ln2.hook_normalized"
DEFAULT_OUTPUT_HOOK = "blocks.{L}.hook_mlp_out"


class CrossLayerTranscoder(nn.Module):
    """A cross-layer transcoder over `n_layers` layers of width `d_model`, `d_transcoder`
    features a layer (see the module docstring for what it computes).

    `activation` is "jumprelu" (a threshold a feature, as the published CLTs), "relu" or "topk"
    (the `k` largest pre-activations of each layer at each position). `input_hook` and
    `output_hook` name where layer L's encoder reads and its decoders write, with "{L}" for the
    layer. `metadata` is free (where it was trained, ...), kept in its files.
    """

    def __init__(self, n_layers: int, d_model: int, d_transcoder: int,
                 activation: str = "jumprelu", k: int | None = None,
                 input_hook: str = DEFAULT_INPUT_HOOK, output_hook: str = DEFAULT_OUTPUT_HOOK,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 metadata: dict[str, Any] | None = None):
        super().__init__()
        check_shape(n_layers, d_model, d_transcoder)
        check_activation(activation, k, d_transcoder)
        check_hook_template(input_hook, "input_hook")
        check_hook_template(output_hook, "output_hook")
        self.n_layers, self.d_model, self.d_transcoder = n_layers, d_model, d_transcoder
        self.activation, self.k = activation, k
        self.input_hook, self.output_hook = input_hook, output_hook
        self.metadata = dict(metadata or {})
        L, d, f = n_layers, d_model, d_transcoder
        factory = {"dtype": dtype, "device": device}
        # Init as "Circuit Tracing" (2025) does: encoders U(+-1/sqrt(d_tc)), decoders
        # U(+-1/sqrt(L * d_model)) (each output sums up to L layers' writes), biases zero.
        enc_bound, dec_bound = f ** -0.5, (L * d) ** -0.5
        self.W_enc = nn.Parameter(torch.empty(L, d, f, **factory).uniform_(-enc_bound, enc_bound))
        self.b_enc = nn.Parameter(torch.zeros(L, f, **factory))  # (L, d_tc)
        self.W_dec = nn.ParameterList(
            nn.Parameter(torch.empty(f, L - layer, d, **factory).uniform_(-dec_bound, dec_bound))
            for layer in range(L))  # [l]: (d_tc, L - l, d_model)
        self.b_dec = nn.Parameter(torch.zeros(L, d, **factory))  # (L, d_model)
        self.threshold = (nn.Parameter(torch.zeros(L, f, **factory))  # (L, d_tc)
                          if activation == "jumprelu" else None)

    # --- where it reads and writes ----------------------------------------------------------

    def input_hook_at(self, layer: int) -> str:
        """The hook point layer `layer`'s encoder reads: "blocks.3.ln2.hook_normalized"."""
        return self.input_hook.replace("{L}", str(self._layer(layer)))

    def output_hook_at(self, layer: int) -> str:
        """The hook point whose value the decoders reconstruct at `layer`."""
        return self.output_hook.replace("{L}", str(self._layer(layer)))

    # --- the transcoder ----------------------------------------------------------------------

    def pre_acts_layer(self, x: Tensor, layer: int) -> Tensor:
        """x (..., d_model) at layer `layer`'s input -> its pre-activations (..., d_tc)."""
        layer = self._layer(layer)
        return x.to(self.W_enc.dtype) @ self.W_enc[layer] + self.b_enc[layer]

    def activate(self, pre: Tensor, layer: int) -> Tensor:
        """Layer `layer`'s pre-activations (..., d_tc) -> its features (..., d_tc)."""
        return ACTIVATION_OF[self.activation](self, pre, self._layer(layer))

    def encode_layer(self, x: Tensor, layer: int) -> Tensor:
        """x (..., d_model), layer `layer`'s MLP input -> its features (..., d_tc)."""
        return self.activate(self.pre_acts_layer(x, layer), layer)

    def encode(self, x: Tensor) -> Tensor:
        """x (n_layers, ..., d_model), every layer's MLP input -> features (n_layers, ...,
        d_tc)."""
        self._check_stacked(x, self.d_model, "x")
        return torch.stack([self.encode_layer(x[layer], layer)
                            for layer in range(self.n_layers)])

    def decode(self, acts: Tensor) -> Tensor:
        """Features (n_layers, ..., d_tc) -> every layer's MLP output (n_layers, ..., d_model):
        layer t's is the sum of what layers 0..t write to it, plus b_dec[t]."""
        self._check_stacked(acts, self.d_transcoder, "acts")
        L, d = self.n_layers, self.d_model
        flat = acts.to(self.b_dec.dtype).reshape(L, -1, self.d_transcoder)  # (L, N, d_tc)
        out = self.b_dec[:, None, :].expand(L, flat.shape[1], d)  # (L, N, d)
        for source in range(L):
            rows = self.W_dec[source].reshape(self.d_transcoder, (L - source) * d)
            writes = (flat[source] @ rows).reshape(-1, L - source, d)  # (N, L - source, d)
            out = out + F.pad(writes.transpose(0, 1), (0, 0, 0, 0, source, 0))  # (L, N, d)
        return out.reshape(L, *acts.shape[1:-1], d)

    def decoder_rows(self, layer: int) -> Tensor:
        """Layer `layer`'s decoders (d_tc, n_layers - layer, d_model): feature i writes
        [i, t - layer] into the MLP output of layer t >= layer."""
        return self.W_dec[self._layer(layer)]

    def forward(self, x: Tensor) -> Tensor:
        """x (n_layers, ..., d_model) -> decode(encode(x)) (n_layers, ..., d_model)."""
        return self.decode(self.encode(x))

    # --- files -------------------------------------------------------------------------------

    @classmethod
    def load(cls, path: str | Path, device: str | torch.device = "cpu",
             dtype: torch.dtype = torch.float32) -> CrossLayerTranscoder:
        """The CLT in the directory `path`, circuit-tracer's layout (W_enc_i/W_dec_i
        .safetensors and config.yaml), every file checked first
        (glassgpt.interp.sae.circuit_tracer_clt.load_clt)."""
        from glassgpt.interp.sae.circuit_tracer_clt import load_clt  # it imports this module

        return load_clt(path, dtype, device)

    def save(self, path: str | Path, overwrite: bool = False) -> Path:
        """Write the CLT to the directory `path` in circuit-tracer's layout, whole or not at
        all (glassgpt.interp.sae.circuit_tracer_clt.save_clt)."""
        from glassgpt.interp.sae.circuit_tracer_clt import save_clt

        return save_clt(self, path, overwrite)

    # --- checks ------------------------------------------------------------------------------

    def _layer(self, layer: int) -> int:
        if isinstance(layer, bool) or not isinstance(layer, int) or \
                not 0 <= layer < self.n_layers:
            raise InputError(f"layer {layer!r:.20} is not one of the CLT's 0..{self.n_layers - 1}")
        return layer

    def _check_stacked(self, t: Tensor, width: int, name: str) -> None:
        if t.ndim < 2 or t.shape[0] != self.n_layers or t.shape[-1] != width:
            raise InputError(f"{name} has shape {tuple(t.shape)}; the CLT takes (n_layers = "
                             f"{self.n_layers}, ..., {width})")

    def extra_repr(self) -> str:
        k = f", k={self.k}" if self.k is not None else ""
        return (f"{self.activation}{k}, n_layers={self.n_layers}, d_model={self.d_model}, "
                f"d_transcoder={self.d_transcoder}, {self.input_hook} -> {self.output_hook}")


def jump_relu(clt: CrossLayerTranscoder, pre: Tensor, layer: int) -> Tensor:
    """z H(z - theta): a feature passes its pre-activation above its threshold, else 0."""
    return pre * (pre > clt.threshold[layer]).to(pre.dtype)


def relu(clt: CrossLayerTranscoder, pre: Tensor, layer: int) -> Tensor:
    return F.relu(pre)


def top_k(clt: CrossLayerTranscoder, pre: Tensor, layer: int) -> Tensor:
    """The k largest pre-activations of the layer at each position (after a ReLU), 0 else."""
    values, indices = torch.topk(pre, k=clt.k, dim=-1, sorted=False)  # (..., k)
    return torch.zeros_like(pre).scatter(-1, indices, values.relu())  # (..., d_tc)


ACTIVATION_OF: dict[str, Callable[[CrossLayerTranscoder, Tensor, int], Tensor]] = {
    "jumprelu": jump_relu, "relu": relu, "topk": top_k}


def check_shape(n_layers: Any, d_model: Any, d_transcoder: Any) -> None:
    for name, value in (("n_layers", n_layers), ("d_model", d_model),
                        ("d_transcoder", d_transcoder)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"a CLT's {name} must be a positive integer, got {value!r:.40}")


def check_activation(activation: Any, k: Any, d_transcoder: int) -> None:
    if activation not in ACTIVATIONS:
        raise ConfigError(f"a CLT's activation is one of {', '.join(ACTIVATIONS)}, got "
                          f"{activation!r:.40}")
    if activation == "topk":
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= d_transcoder:
            raise ConfigError(f"a TopK CLT keeps k of its {d_transcoder} features a layer: k "
                              f"must be in 1..{d_transcoder}, got {k!r:.40}")
    elif k is not None:
        raise ConfigError(f"k is a TopK CLT's setting, not a {activation} one's")


def check_hook_template(template: Any, name: str) -> None:
    """"blocks.{L}.ln2.hook_normalized": a hook point's name with "{L}" for the layer."""
    if not isinstance(template, str) or "{L}" not in template:
        raise ConfigError(f"a CLT's {name} names a hook point with {{L}} for the layer "
                          f"(e.g. {DEFAULT_INPUT_HOOK!r}), got {template!r:.60}")
