"""`SAE`: a sparse dictionary over one hook point (or a transcoder from one point to another),
computing what SAELens 6.x's inference SAEs compute, op for op, so that encode and decode agree
with SAELens's to the last bit in float32.

Notation: x (..., d_in) an activation; f (..., d_sae) the latents; x_hat (..., d_out) the
reconstruction (d_out = d_in except for a transcoder); n_i = ||W_dec[i]|| a decoder row's norm.

    pre   = x_c @ W_enc + b_enc     x_c = x - b_dec when apply_b_dec_to_input   hook_sae_acts_pre
    f     = the architecture's activation of pre (ReLU, TopK, JumpReLU)      hook_sae_acts_post
    x_hat = f @ W_dec + b_dec    (f / n @ W_dec + b_dec for topk with rescale)   hook_sae_recons

The first two lines are glassgpt.interp.sae.encoding's (`pre_acts`, `ACTIVATIONS`); what else
differs between architectures is read from their records (glassgpt.interp.sae.architectures):
a JumpReLU's threshold, a transcoder's output width. A BatchTopK dictionary runs as "jumprelu"
with one threshold for every latent, as SAELens runs it after training.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor, nn

from glassgpt.interp.sae import disk
from glassgpt.interp.sae.config import DTYPES, SAEConfig
from glassgpt.interp.sae.encoding import ACTIVATIONS, pre_acts

# visit(point, tensor) -> tensor: what the splice in glassgpt.interp.sae.splice reads or replaces
# at each of the dictionary's points ("hook_sae_acts_post", ...); encode/decode pass it through.
Visit = Callable[[str, Tensor], Tensor]


def _unchanged(point: str, tensor: Tensor) -> Tensor:
    return tensor


class SAE(nn.Module):
    """A sparse autoencoder (or transcoder) with SAELens's weights, names and file format.

    Build one from an `SAEConfig` (weights initialised as SAELens initialises them), or read
    one with `SAE.load(path)`; `save(path)` writes SAELens's cfg.json and
    sae_weights.safetensors. `log_sparsity` (d_sae,) is log10 of each latent's firing frequency
    when the dictionary came with SAELens's sparsity.safetensors, else None.
    """

    def __init__(self, cfg: SAEConfig):
        super().__init__()
        self.cfg = dataclasses.replace(cfg)  # its own: moving this SAE rewrites its dtype, device
        self.log_sparsity: Tensor | None = None
        dtype = DTYPES[cfg.dtype]
        d_out = cfg.width_out
        W_dec = torch.empty(cfg.d_sae, d_out, dtype=dtype)  # (d_sae, d_out)
        nn.init.kaiming_uniform_(W_dec)
        if cfg.is_transcoder:  # input and output spaces differ: two independent matrices
            W_enc = torch.empty(cfg.d_in, cfg.d_sae, dtype=dtype)
            nn.init.kaiming_uniform_(W_enc)
        else:  # SAELens starts the encoder as the decoder's transpose
            W_enc = W_dec.T.clone()
        self.W_enc = nn.Parameter(W_enc.contiguous())  # (d_in, d_sae)
        self.b_enc = nn.Parameter(torch.zeros(cfg.d_sae, dtype=dtype))  # (d_sae,)
        self.W_dec = nn.Parameter(W_dec)  # (d_sae, d_out)
        self.b_dec = nn.Parameter(torch.zeros(d_out, dtype=dtype))  # (d_out,)
        if "threshold" in cfg.arch.tensors:  # a JumpReLU's
            self.threshold = nn.Parameter(torch.zeros(cfg.d_sae, dtype=dtype))  # (d_sae,)
        else:
            self.threshold = None
        self.to(cfg.device)

    # --- the dictionary ----------------------------------------------------------------------

    def encode(self, x: Tensor) -> Tensor:
        """x (..., d_in) -> the latents f (..., d_sae)."""
        return self.encode_visiting(x, _unchanged)

    def decode(self, f: Tensor) -> Tensor:
        """f (..., d_sae) -> the reconstruction x_hat (..., d_out)."""
        return self.decode_visiting(f, _unchanged)

    def forward(self, x: Tensor) -> Tensor:
        """x (..., d_in) -> decode(encode(x)) (..., d_out)."""
        return self.decode(self.encode(x))

    def encode_visiting(self, x: Tensor, visit: Visit) -> Tensor:
        """encode, with `visit` reading or replacing the input, the pre-activations and the
        latents at SAELens's points (hook_sae_input, hook_sae_acts_pre, hook_sae_acts_post)."""
        sae_in = visit("hook_sae_input", x.to(self.W_enc.dtype))
        pre = visit("hook_sae_acts_pre", pre_acts(self, sae_in))  # (..., d_sae)
        return visit("hook_sae_acts_post", self.activation(pre))

    def decode_visiting(self, f: Tensor, visit: Visit) -> Tensor:
        """decode, with `visit` reading or replacing the reconstruction (hook_sae_recons)."""
        if self.cfg.rescale_acts_by_decoder_norm:  # undo the ranking's scale (SAELens's order)
            f = f * (1 / self.W_dec.norm(dim=-1))
        return visit("hook_sae_recons", f @ self.W_dec + self.b_dec)  # (..., d_out)

    def activation(self, pre: Tensor) -> Tensor:
        """The pre-activations (..., d_sae) -> the latents (..., d_sae): the activation of the
        dictionary's architecture."""
        return ACTIVATIONS[self.cfg.arch.activation](self, pre)

    # --- files -------------------------------------------------------------------------------

    @classmethod
    def load(cls, path: str | Path, device: str | torch.device = "cpu",
             dtype: str | None = None) -> SAE:
        """The dictionary SAELens (or glassgpt) saved in the directory `path`: cfg.json,
        sae_weights.safetensors and, when present, sparsity.safetensors. Everything is checked
        (fields, names, shapes, finite values) before anything is built: a CheckpointError names
        the first thing wrong. `dtype` (a name such as "float32") overrides cfg.json's."""
        saved = disk.read_sae(path, dtype)
        sae = cls(saved.config)
        with torch.no_grad():
            for name, tensor in saved.tensors.items():
                getattr(sae, name).copy_(tensor)
        sae.log_sparsity = saved.log_sparsity
        return sae.to(device)

    def save(self, path: str | Path, overwrite: bool = False) -> Path:
        """Write the dictionary to the directory `path` as SAELens writes it (cfg.json,
        sae_weights.safetensors, and sparsity.safetensors when `log_sparsity` is known). The
        directory appears whole or not at all; an existing one is replaced only with
        `overwrite`, and only when it holds nothing but a dictionary's files."""
        return disk.write_sae(path, self.cfg.to_dict(), self.state_dict(), self.log_sparsity,
                              overwrite)

    def _apply(self, fn: Callable, recurse: bool = True) -> SAE:
        """.to(), .double(), .cuda() move the weights; cfg's dtype and device follow, so
        that a saved cfg.json says what its tensors are."""
        super()._apply(fn, recurse)
        if self.log_sparsity is not None:
            self.log_sparsity = fn(self.log_sparsity)
        self.cfg.device = str(self.W_enc.device)
        self.cfg.dtype = str(self.W_enc.dtype).removeprefix("torch.")
        return self

    def extra_repr(self) -> str:
        hooks = self.cfg.hook_name if not self.cfg.is_transcoder else \
            f"{self.cfg.hook_name} -> {self.cfg.hook_name_out}"
        return (f"{self.cfg.architecture}, d_in={self.cfg.d_in}, d_sae={self.cfg.d_sae}, "
                f"hook={hooks}")
