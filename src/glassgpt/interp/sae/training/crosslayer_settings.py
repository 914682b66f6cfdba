"""`CrossLayerSettings`: what `train_crosslayer` trains, a cross-layer transcoder over every
MLP of a model (torch-free, so that `glassgpt sae train-clt --help` answers at once).

The objective is Anthropic's "Circuit Tracing" (2025) as llamascopium's CLT computes it
(glassgpt.interp.sae.training.crosslayer_objective); the names of its settings follow
llamascopium's where it has one (l1_coefficient, tanh_stretch_coefficient,
jumprelu_threshold_window), and DictionarySettings's for what the two trainers share.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from glassgpt.config import setting
from glassgpt.errors import ConfigError
from glassgpt.interp.sae.training.settings import (
    NORMALIZATIONS,
    non_negative,
    whole_number,
)

CLT_ARCHITECTURES = ("jumprelu", "topk")


@dataclass
class CrossLayerSettings:
    """Every setting of a CLT's training, checked when built (ConfigError naming the first
    wrong field). Layer L's encoder reads `blocks.L.<input_point>`, its decoders write
    `blocks.T.<output_point>` for T >= L."""

    d_transcoder: int = setting(0, "features per layer")
    architecture: str = setting("jumprelu", "jumprelu (tanh sparsity penalty) or topk")
    k: int | None = setting(None, "topk: features kept per layer and token")
    l1_coefficient: float = setting(
        0.3, "jumprelu: weight of the sparsity penalty sum tanh(c * ||W_dec|| * f) (0.3: "
        "measured on the quick-start run, docs/interpretability.md)")
    tanh_stretch_coefficient: float = setting(4.0, "jumprelu: c of the sparsity penalty")
    sparsity_warm_up_steps: int = setting(0, "steps over which the penalty's weight rises "
                                          "from 0")
    jumprelu_init_threshold: float = setting(0.03, "jumprelu: starting threshold")
    jumprelu_threshold_window: float = setting(0.1, "jumprelu: straight-through estimator "
                                               "width")
    input_point: str = setting("ln2.hook_normalized", "what each layer's encoder reads, "
                               "inside block L (the MLP's input, normalised)")
    output_point: str = setting("hook_mlp_out", "what the decoders reconstruct, inside "
                                "block T")
    tokens: int = setting(2_000_000, "activations (token positions) to train on in all")
    batch_tokens: int = setting(1024, "token positions per optimizer step")
    context: int = setting(128, "tokens per window the model reads (at most its block_size)")
    lr: float = setting(1e-3, "Adam learning rate")
    adam_beta1: float = setting(0.9, "Adam beta1")
    adam_beta2: float = setting(0.999, "Adam beta2")
    lr_warm_up_steps: int = setting(0, "steps of linear lr warm-up")
    lr_decay_steps: int | None = setting(None, "last steps of linear lr decay to 0 (default: "
                                         "a fifth of the steps)")
    normalize_activations: str = setting(
        "expected_average_only_in", "expected_average_only_in: each layer's inputs and targets "
        "scaled so that their mean norm is sqrt(d_model), folded into the saved weights; none")
    dead_tokens: int = setting(1_000_000, "a feature silent for this many tokens is dead")
    eval_every: int = setting(100, "steps between metric reports (0: only at the end)")
    eval_windows: int = setting(8, "windows of held-out data per metric report")
    checkpoint_every: int = setting(500, "steps between checkpoints (0: only at the end)")
    seed: int = setting(0, "seed of the initialisation and of the windows drawn")

    def __post_init__(self) -> None:
        if self.architecture not in CLT_ARCHITECTURES:
            raise ConfigError(f"architecture {self.architecture!r:.40} is none of "
                              f"{', '.join(CLT_ARCHITECTURES)}")
        if self.normalize_activations not in NORMALIZATIONS:
            raise ConfigError(f"normalize_activations {self.normalize_activations!r:.40} is "
                              f"none of {', '.join(NORMALIZATIONS)}")
        for name in ("d_transcoder", "tokens", "batch_tokens", "context", "dead_tokens",
                     "eval_windows"):
            if whole_number(getattr(self, name), name) == 0:
                raise ConfigError(f"{name} must be a positive integer, got "
                                  f"{getattr(self, name)}")
        for name in ("sparsity_warm_up_steps", "lr_warm_up_steps", "eval_every",
                     "checkpoint_every", "seed"):
            whole_number(getattr(self, name), name)
        for name in ("l1_coefficient", "jumprelu_init_threshold"):
            non_negative(getattr(self, name), name)
        for name in ("lr", "tanh_stretch_coefficient", "jumprelu_threshold_window"):
            if non_negative(getattr(self, name), name) == 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("adam_beta1", "adam_beta2"):
            if not 0 <= non_negative(getattr(self, name), name) < 1:
                raise ConfigError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        for name in ("input_point", "output_point"):
            point = getattr(self, name)
            if not isinstance(point, str) or not point or point.startswith("blocks."):
                raise ConfigError(f"{name} names a point inside a block (e.g. "
                                  f"ln2.hook_normalized), got {point!r:.60}")
        self._check_k()
        if self.tokens < self.batch_tokens:
            raise ConfigError(f"tokens={self.tokens} is less than one batch of "
                              f"batch_tokens={self.batch_tokens}")
        if self.lr_decay_steps is None:
            self.lr_decay_steps = self.steps // 5
        whole_number(self.lr_decay_steps, "lr_decay_steps")
        if self.lr_warm_up_steps + self.lr_decay_steps > self.steps:
            raise ConfigError(f"lr_warm_up_steps + lr_decay_steps = "
                              f"{self.lr_warm_up_steps + self.lr_decay_steps} is more than "
                              f"the {self.steps} steps")

    def _check_k(self) -> None:
        if self.architecture == "topk":
            if self.k is None or whole_number(self.k, "k") == 0 or self.k > self.d_transcoder:
                raise ConfigError(f"a topk CLT keeps k of its {self.d_transcoder} features a "
                                  f"layer: k must be in 1..{self.d_transcoder}, got {self.k}")
        elif self.k is not None:
            raise ConfigError("k is a setting of topk, not of jumprelu")

    @property
    def steps(self) -> int:
        return self.tokens // self.batch_tokens

    def input_hook(self, layer: int | str = "{L}") -> str:
        return f"blocks.{layer}.{self.input_point}"

    def output_hook(self, layer: int | str = "{L}") -> str:
        return f"blocks.{layer}.{self.output_point}"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
