"""`DictionarySettings`: what `train_dictionary` trains. The defaults of architecture, lr,
l0_coefficient, normalize_activations and resample_every were chosen by measurement for a good
dictionary in minutes on a laptop (docs/interpretability.md, "The defaults, by measurement");
the others are SAELens 6's training defaults.

Names follow SAELens's runner config where one exists (l1_coefficient, l0_coefficient,
lr_warm_up_steps, lr_decay_steps, aux_loss_coefficient, topk_threshold_lr, decoder_init_norm,
jumprelu_init_threshold, jumprelu_bandwidth); `dead_tokens` replaces its `dead_feature_window`
(steps) with the number of tokens a latent may go without firing before it counts as dead.
What each architecture needs and reads (k, a transcoder) is its record's
(glassgpt.interp.sae.architectures), read here without torch.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import asdict, dataclass, fields
from typing import Any

from glassgpt.config import setting
from glassgpt.config_checks import INT64_MAX
from glassgpt.errors import ConfigError
from glassgpt.hooknames import parse_hook_name
from glassgpt.interp.sae.architectures import REGISTRY, TRAINABLE, listed

ARCHITECTURES = TRAINABLE  # what `architecture` takes (and `sae train --architecture`)
# SAELens's normalize_activations that a training may use: the scale is folded into the
# weights when it is saved, so the saved dictionary reads raw activations (its cfg says "none")
NORMALIZATIONS = ("none", "expected_average_only_in")


@dataclass
class DictionarySettings:
    """Every setting of a dictionary's training; checked when built (ConfigError naming the
    first wrong field). `hook_out` is where a transcoder writes (default: the MLP output of
    the block whose MLP input `hook` is)."""

    hook: str = setting("", "the hook point the dictionary reads")
    d_sae: int = setting(0, "number of latents")
    architecture: str = setting("jumprelu", listed([REGISTRY[name].label
                                                    for name in ARCHITECTURES]))
    transcoder: bool = setting(False, "reconstruct hook_out from hook (an MLP's transcoder)")
    hook_out: str | None = setting(None, "a transcoder's target point")
    k: float | None = setting(None, "topk: latents kept per token; batchtopk: on average")
    l1_coefficient: float = setting(5.0, "standard: weight of the decoder-norm-weighted L1")
    l0_coefficient: float = setting(5.0, "jumprelu: weight of the L0 penalty")
    sparsity_warm_up_steps: int = setting(0, "steps over which the L1/L0 weight rises from 0")
    tokens: int = setting(2_000_000, "activations to train on in all")
    batch_tokens: int = setting(4096, "activations per optimizer step")
    context: int = setting(128, "tokens per window the model reads (at most its block_size)")
    lr: float = setting(3e-3, "Adam learning rate")
    adam_beta1: float = setting(0.9, "Adam beta1")
    adam_beta2: float = setting(0.999, "Adam beta2")
    lr_warm_up_steps: int = setting(0, "steps of linear lr warm-up")
    lr_decay_steps: int | None = setting(None, "last steps of linear lr decay to 0 (default: "
                                         "a fifth of the steps)")
    decoder_init_norm: float = setting(0.1, "norm of each decoder row at the start")
    normalize_activations: str = setting(
        "expected_average_only_in", "expected_average_only_in: train on inputs (and targets) "
        "scaled so that their mean norm is sqrt(width), the scale folded into the saved weights "
        "(SAELens's); none")
    resample_every: int = setting(50, "standard/jumprelu: steps between resamplings of the "
                                  "dead latents from high-loss inputs, in the first half of "
                                  "the training (Bricken et al. 2023); 0: never")
    aux_loss_coefficient: float = setting(1.0, "topk/batchtopk: weight of the AuxK loss")
    topk_threshold_lr: float = setting(0.01, "batchtopk: rate of the threshold's moving "
                                       "average")
    jumprelu_init_threshold: float = setting(0.01, "jumprelu: starting threshold")
    jumprelu_bandwidth: float = setting(0.05, "jumprelu: straight-through estimator width")
    dead_tokens: int = setting(1_000_000, "a latent silent for this many tokens is dead")
    eval_every: int = setting(100, "steps between metric reports (0: only at the end)")
    eval_windows: int = setting(8, "windows of held-out data per metric report")
    checkpoint_every: int = setting(500, "steps between checkpoints (0: only at the end)")
    seed: int = setting(0, "seed of the initialisation and of the windows drawn")

    def __post_init__(self) -> None:
        if not isinstance(self.hook, str) or not self.hook:
            raise ConfigError("hook must name a hook point, e.g. blocks.0.hook_resid_post")
        if self.architecture not in ARCHITECTURES:
            raise ConfigError(f"architecture {self.architecture!r:.40} is none of "
                              f"{', '.join(ARCHITECTURES)}")
        if self.normalize_activations not in NORMALIZATIONS:
            raise ConfigError(f"normalize_activations {self.normalize_activations!r:.40} is "
                              f"none of {', '.join(NORMALIZATIONS)}")
        for name in ("d_sae", "tokens", "batch_tokens", "context", "dead_tokens",
                     "eval_windows"):
            _positive_int(getattr(self, name), name)
        for name in ("sparsity_warm_up_steps", "lr_warm_up_steps", "eval_every",
                     "checkpoint_every", "seed", "resample_every"):
            whole_number(getattr(self, name), name)
        for name in ("l1_coefficient", "l0_coefficient", "aux_loss_coefficient"):
            non_negative(getattr(self, name), name)
        for name in ("lr", "decoder_init_norm", "topk_threshold_lr", "jumprelu_bandwidth"):
            if non_negative(getattr(self, name), name) == 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        non_negative(self.jumprelu_init_threshold, "jumprelu_init_threshold")
        for name in ("adam_beta1", "adam_beta2"):
            if not 0 <= non_negative(getattr(self, name), name) < 1:
                raise ConfigError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        if self.tokens < self.batch_tokens:
            raise ConfigError(f"tokens={self.tokens} is less than one batch of "
                              f"batch_tokens={self.batch_tokens}")
        self._check_k()
        self._check_read()
        self._check_transcoder()
        if self.lr_decay_steps is None:
            self.lr_decay_steps = self.steps // 5
        whole_number(self.lr_decay_steps, "lr_decay_steps")
        if self.lr_warm_up_steps + self.lr_decay_steps > self.steps:
            raise ConfigError(f"lr_warm_up_steps + lr_decay_steps = "
                              f"{self.lr_warm_up_steps + self.lr_decay_steps} is more than "
                              f"the {self.steps} steps")

    def _check_k(self) -> None:
        kind = REGISTRY[self.architecture].k  # "count", "mean" or None (takes no k)
        if kind is not None:
            if self.k is None:
                raise ConfigError(f"the {self.architecture} architecture needs k (--k)")
            if kind == "count":
                _positive_int(self.k, "k")
            elif non_negative(self.k, "k") == 0:
                raise ConfigError(f"k must be positive, got {self.k}")
            if self.k > self.d_sae:
                raise ConfigError(f"k = {self.k} latents of d_sae = {self.d_sae}")
        elif self.k is not None:
            takers = [name for name in ARCHITECTURES if REGISTRY[name].k is not None]
            raise ConfigError(f"k is a setting of {listed(takers, 'and')}, not of "
                              f"{self.architecture}")

    def _check_read(self) -> None:
        """A setting that only other architectures read, changed from its default, trains
        nothing different: it is a mistake (`--l1` with topk), refused by name."""
        own = REGISTRY[self.architecture].settings
        for field in fields(self):
            readers = [name for name in ARCHITECTURES if field.name in REGISTRY[name].settings]
            if field.name == "k" or field.name in own or not readers:
                continue
            if getattr(self, field.name) != field.default:
                raise ConfigError(f"{field.name} is a setting of {listed(readers, 'and')}, not "
                                  f"of {self.architecture}")

    def _check_transcoder(self) -> None:
        if not self.transcoder:
            if self.hook_out is not None:
                raise ConfigError("hook_out is a transcoder's setting (transcoder=True)")
            return
        if REGISTRY[self.architecture].transcoder_form is None:
            forms = [name for name in ARCHITECTURES if REGISTRY[name].transcoder_form]
            raise ConfigError(f"SAELens's transcoders are {listed(forms)}, not "
                              f"{self.architecture}")
        if self.hook_out is None:
            read = parse_hook_name(self.hook)
            if read.layer is None or (read.module, read.point) != ("ln2", "hook_normalized"):
                raise ConfigError(f"a transcoder of {self.hook} needs hook_out (the default "
                                  f"pairs blocks.L.ln2.hook_normalized with "
                                  f"blocks.L.hook_mlp_out)")
            self.hook_out = f"blocks.{read.layer}.hook_mlp_out"

    @property
    def steps(self) -> int:
        """Optimizer steps in all: the whole batches that `tokens` holds."""
        return self.tokens // self.batch_tokens

    @property
    def target_hook(self) -> str:
        """The point whose activations the dictionary reconstructs."""
        return self.hook_out if self.transcoder else self.hook

    @property
    def hooks(self) -> list[str]:
        return list(dict.fromkeys([self.hook, self.target_hook]))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _positive_int(value: Any, name: str) -> int:
    if whole_number(value, name) == 0:
        raise ConfigError(f"{name} must be a positive integer, got {value}")
    return value


def whole_number(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise ConfigError(f"{name} must be a whole number >= 0, got {value!r:.40}")
    if value > INT64_MAX:  # a seed or a size past 64 bits fails deep inside torch
        raise ConfigError(f"{name} must be at most 2**63 - 1, got an integer of "
                          f"{int(value).bit_length()} bits")
    return int(value)


def non_negative(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) \
            or not math.isfinite(value) or value < 0:
        raise ConfigError(f"{name} must be a finite number >= 0, got {value!r:.40}")
    return float(value)
