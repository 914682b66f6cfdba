"""LoRA's settings: the adapters' rank, alpha, dropout and the projections they adapt, checked
when built, and which projections a model's blocks have. Torch-free, so that `glassgpt finetune
--help` lists the targets and defaults from here without loading torch; the adapters themselves
are glassgpt.adapters.lora's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from glassgpt.config import GATED_ACTIVATIONS, GPTConfig, check_dropout
from glassgpt.errors import ConfigError

# Each target: the sub-layer it lives in (its name in lora_state_dict) and the module there.
ATTENTION_TARGETS = ("q", "k", "v", "o")
MLP_TARGETS = ("gate", "up", "down")
TARGETS = ATTENTION_TARGETS + MLP_TARGETS
DEFAULT_TARGETS = ATTENTION_TARGETS
DEFAULT_ALPHA_PER_RANK = 2.0  # alpha 2r: the adapters' outputs scaled by 2, a common choice
# The most alpha / r may be. Published recipes keep it within 1 to 4 (alpha r to 4r), rsLoRA's
# alpha / sqrt(r) a little above; a scale of thousands only multiplies every update (and the
# first steps' overflow) until nothing trains.
MAX_SCALING = 256


@dataclass(frozen=True)
class LoraSettings:
    """The adapters' shape: rank r, alpha (their outputs are scaled by alpha / r; default
    2r), the dropout on their input, and the projections they adapt in every block: q, k, v,
    o (attention's output projection), gate (gated MLPs only), up and down (the MLP's in and
    out). The defaults are `glassgpt finetune --lora-rank R`'s."""

    rank: int
    alpha: float | None = None
    dropout: float = 0.0
    targets: tuple[str, ...] = DEFAULT_TARGETS

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank <= 0:
            raise ConfigError(f"LoRA rank must be a positive integer, got {self.rank!r:.40}")
        if self.alpha is None:
            object.__setattr__(self, "alpha", DEFAULT_ALPHA_PER_RANK * self.rank)
        _check_alpha(self.alpha, self.rank)
        if not _is_number(self.dropout):
            raise ConfigError(f"LoRA dropout must be a number in [0, 1), got "
                              f"{self.dropout!r:.40}")
        check_dropout(self.dropout)
        if isinstance(self.targets, str) or not isinstance(self.targets, (tuple, list)):
            raise ConfigError(f"LoRA targets must be a list of names among "
                              f"{', '.join(TARGETS)}; got {self.targets!r:.60}")
        object.__setattr__(self, "targets", tuple(self.targets))
        unknown = [t for t in self.targets if t not in TARGETS]
        if unknown or not self.targets or len(set(self.targets)) != len(self.targets):
            raise ConfigError(f"LoRA targets must be distinct names among {', '.join(TARGETS)}; "
                              f"got {list(self.targets)}")

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank  # type: ignore[operator]  # alpha is set by now

    def check(self, config: GPTConfig) -> None:
        """ConfigError for a target `config`'s blocks lack (naming those they have) or a rank
        above the narrowest adapted projection's width."""
        available = available_targets(config)
        missing = [t for t in self.targets if t not in available]
        if missing:
            raise ConfigError(f"LoRA targets {missing} are not in this model; its blocks have "
                              f"{', '.join(available)}")
        if config.position == "shortformer" and set(self.targets) & {"q", "k", "v"}:
            raise ConfigError("shortformer positions read qkv's weight apart for q and k, "
                              "where no adapter reaches; adapt o, up or down instead")
        widths = target_widths(config)
        narrowest = min(self.targets, key=lambda t: widths[t])
        if self.rank > widths[narrowest]:
            raise ConfigError(f"LoRA rank {self.rank} is more than the width of {narrowest} "
                              f"({widths[narrowest]}); choose rank <= {widths[narrowest]}")


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_alpha(alpha: object, rank: int) -> None:
    """ConfigError unless alpha is a positive finite number whose scale alpha / rank is at
    most MAX_SCALING (0 adapts nothing; a negative alpha only flips B's sign)."""
    value = float(alpha) if _is_number(alpha) else math.nan  # type: ignore[arg-type]
    if not math.isfinite(value) or value <= 0:
        raise ConfigError(f"LoRA alpha must be a positive finite number, got {alpha!r:.40}")
    if value / rank > MAX_SCALING:
        raise ConfigError(f"LoRA alpha {value:.6g} over rank {rank} scales the adapters by "
                          f"{value / rank:.3g}; the scale alpha / rank must be at most "
                          f"{MAX_SCALING} (alpha is usually r to 4r)")


def available_targets(config: GPTConfig) -> tuple[str, ...]:
    """The targets `config`'s blocks have: attention's four, and the MLP's (gate if gated)."""
    if config.attn_only:
        return ATTENTION_TARGETS
    mlp = MLP_TARGETS if config.activation in GATED_ACTIVATIONS else ("up", "down")
    return ATTENTION_TARGETS + mlp


def target_widths(config: GPTConfig) -> dict[str, int]:
    """min(in, out) of each target's projection: a rank above it adds nothing a full-rank
    update of that width could not."""
    C, F_, q, kv = config.n_embd, config.hidden_width, config.q_width, config.kv_width
    return {"q": min(C, q), "k": min(C, kv), "v": min(C, kv), "o": min(q, C),
            "gate": min(C, F_), "up": min(C, F_), "down": min(F_, C)}
