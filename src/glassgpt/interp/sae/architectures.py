"""Dictionary architectures as records: one `Architecture` a name, SAELens's names, read by
everything that differs between them (the config, the files, the model, the trainer).

    name                 activation  trained as            saved as
    standard             relu        L1 x decoder norms    standard (its transcoder: transcoder)
    topk                 topk        AuxK                  topk, decoder norms folded in
    batchtopk            batchtopk   AuxK                  jumprelu of one threshold
    jumprelu             jumprelu    L0 (straight-through) jumprelu (its transcoder:
                                                           jumprelu_transcoder)
    transcoder           relu        as standard           (reads one point, writes another)
    jumprelu_transcoder  jumprelu    as jumprelu

This module is torch-free (the training settings and `glassgpt sae train --help` read it). The
torch behaviour is keyed by a record's `activation`: the activation of a saved dictionary in
glassgpt.interp.sae.encoding (`ACTIVATIONS`), the training's forward and losses in
glassgpt.interp.sae.training.objective (`FORWARDS`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Architecture:
    """One architecture (see the module docstring). Only `name`, `title` and `activation`
    must be given; the rest say what it adds to the plain ReLU dictionary."""

    name: str  # SAELens's: cfg.json's "architecture", or the training's ("batchtopk")
    title: str  # as a sentence names it: "TopK", "BatchTopK", "JumpReLU"
    # pre-activations -> latents: "relu", "topk", "jumprelu", "batchtopk" (training only)
    activation: str
    note: str = ""  # a word after its name in the --architecture help: standard's "L1"
    transcoder: bool = False  # reads one point and writes another, d_out wide
    saved_as: str | None = None  # a training architecture SAELens saves as another
    transcoder_form: str | None = None  # the architecture of its transcoder, if it has one
    cfg_fields: tuple[str, ...] = ()  # what it adds to cfg.json, in SAELens's order
    tensors: tuple[str, ...] = ()  # the (d_sae,) tensors it adds to W_enc, b_enc, W_dec, b_dec
    losses: tuple[str, ...] = ()  # its training's loss terms beside "mse_loss"
    sparsity_coefficient: str | None = None  # the setting weighing its sparsity loss
    # k: "count" (whole latents per token), "mean" (latents per token, on average), None
    k: str | None = None
    rescales_by_decoder_norm: bool = False  # ranks pre * ||W_dec[i]||; saved with them folded
    batch_threshold: bool = False  # keeps a batch threshold, saved as every latent's threshold
    settings: tuple[str, ...] = ()  # the DictionarySettings fields only some architectures read

    @property
    def trained(self) -> bool:
        """DictionarySettings.architecture takes it (a transcoder is trained as its base
        architecture with transcoder=True)."""
        return not self.transcoder

    @property
    def loadable(self) -> bool:
        """cfg.json may name it (SAELens's inference architectures)."""
        return self.saved_as is None

    @property
    def label(self) -> str:
        return f"{self.name} ({self.note})" if self.note else self.name

    def saved_fields(self, k: float | None) -> dict[str, Any]:
        """SAEConfig's fields (architecture and what it adds) of a dictionary trained as this
        architecture with `k`, as it is saved: SAELens's inference form."""
        fields: dict[str, Any] = {"architecture": self.saved_as or self.name}
        if "k" in self.cfg_fields:
            fields["k"] = int(k)
        if "rescale_acts_by_decoder_norm" in self.cfg_fields:
            fields["rescale_acts_by_decoder_norm"] = self.rescales_by_decoder_norm
        return fields

    def saved_metadata(self, k: float | None) -> dict[str, Any]:
        """What cfg.json's metadata says of a training architecture saved as another:
        SAELens's training_architecture and its details."""
        if self.saved_as is None:
            return {}
        return {"training_architecture": self.name, "training_architecture_details": {"k": k}}


STANDARD = Architecture(
    "standard", "standard", "relu", note="L1", transcoder_form="transcoder",
    losses=("l1_loss",), sparsity_coefficient="l1_coefficient",
    settings=("l1_coefficient", "sparsity_warm_up_steps", "resample_every"))
TOPK = Architecture(
    "topk", "TopK", "topk", cfg_fields=("k", "rescale_acts_by_decoder_norm"),
    losses=("auxk_loss",), k="count", rescales_by_decoder_norm=True,
    settings=("k", "aux_loss_coefficient"))
BATCHTOPK = Architecture(
    "batchtopk", "BatchTopK", "batchtopk", saved_as="jumprelu", losses=("auxk_loss",),
    k="mean", rescales_by_decoder_norm=True, batch_threshold=True,
    settings=("k", "aux_loss_coefficient", "topk_threshold_lr"))
JUMPRELU = Architecture(
    "jumprelu", "JumpReLU", "jumprelu", transcoder_form="jumprelu_transcoder",
    tensors=("threshold",), losses=("l0_loss",), sparsity_coefficient="l0_coefficient",
    settings=("l0_coefficient", "sparsity_warm_up_steps", "jumprelu_init_threshold",
              "jumprelu_bandwidth", "resample_every"))
TRANSCODER = Architecture("transcoder", "transcoder", "relu", transcoder=True,
                          cfg_fields=("d_out",))
JUMPRELU_TRANSCODER = Architecture("jumprelu_transcoder", "JumpReLU transcoder", "jumprelu",
                                   transcoder=True, cfg_fields=("d_out",),
                                   tensors=("threshold",))

REGISTRY = {arch.name: arch for arch in (STANDARD, TOPK, BATCHTOPK, JUMPRELU, TRANSCODER,
                                         JUMPRELU_TRANSCODER)}
LOADABLE = tuple(name for name, arch in REGISTRY.items() if arch.loadable)
TRAINABLE = tuple(name for name, arch in REGISTRY.items() if arch.trained)


def find(name: Any) -> Architecture | None:
    """The record of `name`, or None for anything else (a name glassgpt does not know, or a
    value read from a file that is not a name at all)."""
    return REGISTRY.get(name) if isinstance(name, str) else None


def listed(words: list[str], last: str = "or") -> str:
    """"a, b or c": words as a sentence lists them."""
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} {last} {words[-1]}"
