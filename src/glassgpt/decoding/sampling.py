"""The sampling filter: a model's logits -> the distribution the next token is drawn from.

One function does it for every reader: `generate` draws each token from it, and `glassgpt view`
draws its next-token bars with it and samples through `generate`. The steps, in order:
temperature (divides the logits; 0 is greedy, all the mass on the best token), then top-k (only
the k most likely tokens), then top-p (the smallest set whose probability reaches p). The
settings are checked once, by `SamplingConfig`, whose fields are also the one table of their
defaults (temperature 1, no top-k, no top-p: the model's own distribution).
Shapes: N = rows (any leading axes, flattened), V = vocabulary.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from glassgpt.config import SamplingConfig

# The defaults, read from SamplingConfig's fields (written nowhere else).
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(SamplingConfig)}
DEFAULT_TEMPERATURE: float = _DEFAULTS["temperature"]
DEFAULT_TOP_K: int | None = _DEFAULTS["top_k"]
DEFAULT_TOP_P: float | None = _DEFAULTS["top_p"]

# Below float32's smallest normal number a temperature is 0 to the division (or so near it that
# every token but the best gets probability 0): such a temperature is greedy, its limit.
GREEDY_BELOW = torch.finfo(torch.float32).tiny


def check_filter(temperature: float, top_k: int | None, top_p: float | None) -> None:
    """InputError naming a setting of the filter that is out of range or of the wrong type
    (a NaN or boolean temperature, a top_k of 0, a top_p of 2, ...): SamplingConfig's checks."""
    SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p)


def is_greedy(temperature: float) -> bool:
    """Whether `temperature` puts all the mass on the best token (0, or too small for float32)."""
    return temperature < GREEDY_BELOW


def keep_top_k(logits: Tensor, k: int) -> Tensor:
    """Set every logit below the k-th largest of its row to -inf. (N, V) -> (N, V)."""
    k = min(k, logits.size(-1))
    kth = torch.topk(logits, k, dim=-1).values[:, -1:]  # (N, 1)
    return logits.masked_fill(logits < kth, float("-inf"))


def keep_top_p(logits: Tensor, p: float) -> Tensor:
    """Nucleus filtering: keep the smallest set of tokens whose probability reaches p."""
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)  # (N, V)
    probs = torch.softmax(sorted_logits, dim=-1)
    # A token is dropped when the tokens ranked above it already reach p; the top one never is.
    mass_before = torch.cumsum(probs, dim=-1) - probs
    drop_sorted = mass_before >= p
    # Said and enforced: a p below float32's range compares as 0, which would drop every token.
    drop_sorted[:, 0] = False
    drop = drop_sorted.scatter(-1, order, drop_sorted)  # back to vocabulary order
    return logits.masked_fill(drop, float("-inf"))


def filtered_distribution(logits: Tensor, temperature: float, top_k: int | None,
                          top_p: float | None) -> Tensor:
    """`sampling_distribution` without the check of the settings (the decoding loop checked
    them once): logits (N, V) -> probabilities (N, V) in float32."""
    logits = logits.float()
    if is_greedy(temperature):
        best = logits.argmax(dim=-1, keepdim=True)  # (N, 1)
        return torch.zeros_like(logits).scatter_(-1, best, 1.0)
    # Shift each row's best logit to 0 before dividing: a tiny temperature then sends the
    # others towards -inf instead of sending the best one to +inf (which softmax turns to NaN).
    logits = (logits - logits.amax(dim=-1, keepdim=True)) / temperature
    if top_k is not None:
        logits = keep_top_k(logits, top_k)
    if top_p is not None and top_p < 1.0:
        logits = keep_top_p(logits, top_p)
    return torch.softmax(logits, dim=-1)


def sampling_distribution(logits: Tensor, temperature: float = DEFAULT_TEMPERATURE,
                          top_k: int | None = DEFAULT_TOP_K,
                          top_p: float | None = DEFAULT_TOP_P) -> Tensor:
    """The distribution sampling draws the next token from: logits (..., V) -> probabilities
    (..., V). Temperature, then top-k, then top-p; a temperature of 0 (or below float32's
    range) is greedy. InputError for settings SamplingConfig refuses."""
    check_filter(temperature, top_k, top_p)
    shape = logits.shape
    flat = logits.reshape(-1, shape[-1])  # (N, V): the filters work row by row
    return filtered_distribution(flat, temperature, top_k, top_p).view(shape)


def draw(logits: Tensor, temperature: float, top_k: int | None, top_p: float | None,
         generator: torch.Generator | None = None) -> Tensor:
    """One token per row of logits (N, V) from `filtered_distribution`: (N, 1). Greedy takes
    the argmax and draws no random number; nothing is read back to the host."""
    if is_greedy(temperature):
        return logits.argmax(dim=-1, keepdim=True)
    probs = filtered_distribution(logits, temperature, top_k, top_p)
    return torch.multinomial(probs, num_samples=1, generator=generator)


def finite_rows(logits: Tensor) -> tuple[Tensor, Tensor]:
    """logits (N, V) with each row holding a NaN or infinity set to zeros (so that sampling it
    cannot fail), and whether every row was finite (a 0-dim tensor: nothing is read back)."""
    finite = torch.isfinite(logits).all(dim=-1, keepdim=True)  # (N, 1)
    return logits.masked_fill(~finite, 0.0), finite.all()


def greedy_pick(logits: Tensor, all_finite: Tensor) -> tuple[Tensor, Tensor]:
    """The best token (N, 1) of each row of logits (N, V), and `all_finite` and-ed with whether
    every row was finite (a row that was not takes token 0). The whole of a greedy decoding
    step's choice in one function, which a compiled engine compiles into one loop."""
    logits, finite = finite_rows(logits)
    return logits.argmax(dim=-1, keepdim=True), all_finite & finite


def pick_token(logits: Tensor, all_finite: Tensor, sampling: SamplingConfig,
               generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
    """The next token (N, 1) drawn from logits (N, V) with `sampling`'s filter, and `all_finite`
    and-ed with whether every row was finite (a row that was not is drawn from a uniform row, so
    that nothing fails half way; the caller raises once decoding ends)."""
    if is_greedy(sampling.temperature):
        return greedy_pick(logits, all_finite)
    logits, finite = finite_rows(logits)
    return (draw(logits, sampling.temperature, sampling.top_k, sampling.top_p, generator),
            all_finite & finite)
