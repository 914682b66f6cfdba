"""Head scores: previous-token, duplicate-token and induction, under three named definitions.

`head_scores` reads them on a repeated sequence: tokens prefix + r_0 .. r_{n-1} r_0 .. r_{n-1}
(p prefix tokens, a BOS say, then a half of n tokens written twice). In the second half, at
position i (i >= p + n) a head can look at
    i - 1       the previous token                   (a previous-token head)
    i - n       the same token, first time round     (a duplicate-token head)
    i - n + 1   the token after it, first time round (an induction head: "what came next")
The three tools in use average different cells of the attention pattern, so each is offered by
name (`definition=`) and none is "the" score:
  "glassgpt" (the default): the attention at i - n and i - n + 1 averaged over exactly the
      second half's queries (i >= p + n) and the batch; previous-token over every query after
      the first. Only cells where the head's kind must attend, so a perfect head scores 1.
  "arena": ARENA's and TransformerLens Main_Demo's stripe, `pattern.diagonal(offset=1 - n)`
      averaged over batch and queries (induction_score_hook), which begins n - 1 queries in: it
      also holds p + 1 queries that are not in the second half (with ARENA's one BOS, the last
      two of the first half), so it reads lower than "glassgpt". Previous-token is ARENA's
      `diagonal(-1).mean()`, duplicate-token the same stripe arithmetic at offset -n (ARENA's
      duplicate score in its IOI part, on tokens without a prefix).
  "transformer_lens": TransformerLens's `head_detector.detect_head` with its defaults (the
      "mul" measure, nothing excluded), each row of tokens a sequence of its own, averaged as
      TransformerLens averages a list: the share of ALL the head's attention that lands on the
      cells its kind would attend to. Every query counts, the first half's too, so a perfect
      induction head reads about n / (p + 2n), not 1.
`detect_head` is that TransformerLens function itself, with its options and custom patterns.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from glassgpt.errors import InputError
from glassgpt.interp.core import checks
from glassgpt.interp.core.cache import ActivationCache, cached
from glassgpt.interp.core.hooked import as_glass, check_run_ids, hook_points, run_with_cache

DEFINITIONS = ("glassgpt", "arena", "transformer_lens")
HEAD_KINDS = ("previous_token_head", "duplicate_token_head", "induction_head")
ERROR_MEASURES = ("mul", "abs")


@dataclass(frozen=True)
class HeadScores:
    previous_token: Tensor  # (L, H)
    duplicate_token: Tensor  # (L, H)
    induction: Tensor  # (L, H)
    half: int  # n: the length of the repeated half
    prefix: int = 0  # p: the tokens before the first half (ARENA's BOS: 1)
    definition: str = "glassgpt"  # which cells were averaged (DEFINITIONS)


# --- the tokens: a prefix, then a half written twice ------------------------------------------

def repeated_random_tokens(vocab_size: int, half: int, batch: int,
                           seed: int = 0) -> Tensor:
    """(batch, 2 * half) ids: a random half, then that half again."""
    generator = torch.Generator().manual_seed(seed)
    first = torch.randint(vocab_size, (batch, half), generator=generator)
    return torch.cat([first, first], dim=1)


def repeats_after(tokens: Tensor, prefix: int) -> bool:
    """Whether tokens[:, prefix:] is a half of at least 2 tokens, then that half again."""
    rest = tokens.shape[1] - prefix
    if rest < 4 or rest % 2:
        return False
    half = rest // 2
    return torch.equal(tokens[:, prefix:prefix + half], tokens[:, prefix + half:])


def find_prefix(tokens: Tensor) -> int:
    """The shortest prefix after which `tokens` repeat, looked for only while it is shorter
    than the half (a longer one is more likely a chance repeat near the end: pass prefix=)."""
    T = tokens.shape[1]
    for prefix in range(T % 2, T, 2):
        if prefix >= (T - prefix) // 2:
            break
        if repeats_after(tokens, prefix):
            return prefix
    raise InputError(f"tokens of shape {tuple(tokens.shape)} do not repeat: their second half "
                     "must equal their first, after a prefix shorter than the half (BOS + A + "
                     "A) or one given as prefix=")


def check_repeated(tokens: Tensor, block_size: int, prefix: int | None = None) -> int:
    """tokens (B, p + 2n), n >= 2, p + 2n <= block_size, whose last 2n repeat their first n:
    the prefix p (given, else found); else InputError."""
    check_run_ids(tokens)  # (B, T) integer ids, B and T at least 1
    T = tokens.shape[1]
    if not 4 <= T <= block_size:
        raise InputError(f"tokens must be (batch, p + 2n) with 4 <= p + 2n <= block_size = "
                         f"{block_size}, got shape {tuple(tokens.shape)}")
    if prefix is None:
        return find_prefix(tokens)
    prefix = checks.within("prefix", prefix, 0, T - 4)  # room for two halves of 2
    if not repeats_after(tokens, prefix):
        raise InputError(f"tokens after a prefix of {prefix} do not repeat: their {T - prefix} "
                         "tokens must be an even count whose second half must equal their first")
    return prefix


def random_repeats(model: nn.Module, half: int | None, batch: int, seed: int) -> Tensor:
    block_size = model.config.block_size
    half = block_size // 2 if half is None else half
    if isinstance(half, bool) or not isinstance(half, int) or not 2 <= half <= block_size // 2:
        raise InputError(f"half must be an int in [2, block_size // 2 = {block_size // 2}], "
                         f"got {half!r}")
    checks.within("batch", batch, 1, 2**20)
    checks.within("seed", seed, 0, 2**63 - 1)  # what torch.Generator.manual_seed takes
    return repeated_random_tokens(model.config.vocab_size, half, batch, seed)


# --- the cells each definition averages --------------------------------------------------------

def stripe_mean(pattern: Tensor, back: int, first_query: int) -> Tensor:
    """pattern (B, H, T, T) -> (H,): the mean of pattern[:, :, i, i - back] over the batch and
    the queries i >= first_query (first_query = back: the whole stripe, ARENA's reading)."""
    stripe = pattern.diagonal(offset=-back, dim1=-2, dim2=-1)  # (B, H, T - back): i = back..
    return stripe[..., first_query - back:].mean(dim=(0, 2))


def glassgpt_scores(pattern: Tensor, half: int, prefix: int) -> tuple[Tensor, Tensor, Tensor]:
    second_half = prefix + half
    return (stripe_mean(pattern, 1, 1), stripe_mean(pattern, half, second_half),
            stripe_mean(pattern, half - 1, second_half))


def arena_scores(pattern: Tensor, half: int, prefix: int) -> tuple[Tensor, Tensor, Tensor]:
    # ARENA's stripes start where the diagonal does, whatever the prefix
    return (stripe_mean(pattern, 1, 1), stripe_mean(pattern, half, half),
            stripe_mean(pattern, half - 1, half - 1))


# --- TransformerLens's detection patterns and their measure -----------------------------------

def previous_token_pattern(tokens: Tensor) -> Tensor:
    """tokens (T,) -> (T, T): 1 at [i, i - 1], each query's previous token."""
    return torch.ones(tokens.shape[-1] - 1).diag(-1)


def duplicate_token_pattern(tokens: Tensor) -> Tensor:
    """tokens (T,) -> (T, T): 1 at [i, j] for each earlier j < i holding the same token."""
    same = tokens[:, None] == tokens[None, :]  # (T, T)
    return same.tril(diagonal=-1).float()


def induction_pattern(tokens: Tensor) -> Tensor:
    """tokens (T,) -> (T, T): 1 at [i, j] for each j whose previous token j - 1 < i is a
    copy of token i: the token that followed it before."""
    duplicates = duplicate_token_pattern(tokens)
    shifted = torch.zeros_like(duplicates)
    shifted[:, 1:] = duplicates[:, :-1]  # key j - 1 -> key j; j - 1 < i keeps it causal
    return shifted


PATTERN_OF_KIND = {"previous_token_head": previous_token_pattern,
                   "duplicate_token_head": duplicate_token_pattern,
                   "induction_head": induction_pattern}


def similarity(pattern: Tensor, detection: Tensor, exclude_bos: bool,
               exclude_current_token: bool, error_measure: str) -> Tensor:
    """pattern (H, T, T) of one sequence, detection (T, T) -> (H,): TransformerLens's match.
    "mul": the share of the (kept) attention on the detection's cells. "abs": 1 - the summed
    |pattern - detection| over T, rounded to 3 decimals as TransformerLens rounds it."""
    kept = torch.ones_like(detection)
    if exclude_bos:
        kept[:, 0] = 0
    if exclude_current_token:
        kept.fill_diagonal_(0)
    if error_measure == "mul":
        pattern = pattern * kept  # a copy: the caller's cache stays whole
        return (pattern * detection).sum(dim=(-2, -1)) / pattern.sum(dim=(-2, -1))
    T = detection.shape[-1]
    distance = ((pattern - detection).abs() * kept).mean(dim=(-2, -1)) * T  # (H,)
    # Python's round on each head's float, as TransformerLens rounds: ties alike
    return torch.tensor([1 - round(value, 3) for value in distance.tolist()])


def detection_scores(patterns: Sequence[Tensor], tokens: Tensor, kind: str | Tensor,
                     **options: Any) -> Tensor:
    """patterns: L of (B, H, T, T), tokens (B, T) -> (L, H): each row's match to the detection
    pattern (a kind's, from that row's tokens, or one (T, T) for all), averaged over rows."""
    rows = []
    for b in range(tokens.shape[0]):
        detection = PATTERN_OF_KIND[kind](tokens[b].cpu()) if isinstance(kind, str) else kind
        detection = detection.to(patterns[0].device, torch.float32)
        rows.append(torch.stack([similarity(p[b].float(), detection, **options)
                                 for p in patterns]).cpu())
    return torch.stack(rows).mean(dim=0)  # (B, L, H) -> (L, H)


def transformer_lens_scores(patterns: Sequence[Tensor], tokens: Tensor) -> list[Tensor]:
    options = dict(exclude_bos=False, exclude_current_token=False, error_measure="mul")
    return [detection_scores(patterns, tokens, kind, **options) for kind in HEAD_KINDS]


# --- the entry points --------------------------------------------------------------------------

def layer_patterns(model: nn.Module, ids: Tensor) -> list[Tensor]:
    """ids (B, T) -> every layer's attention pattern (B, H, T, T) in float32, from one run
    that stops before the LM head (only the patterns are read)."""
    ids = ids.to(next(model.parameters()).device)
    _, cache = run_with_cache(model, ids, names=lambda n: n.endswith("attn.hook_pattern"),
                              stop_at_layer=model.config.n_layer)
    return [cache[f"blocks.{l}.attn.hook_pattern"].float() for l in range(model.config.n_layer)]


def head_scores(model: nn.Module, half: int | None = None, batch: int = 8,
                seed: int = 0, tokens: Tensor | None = None, *, prefix: int | None = None,
                definition: str = "glassgpt") -> HeadScores:
    """Every head's previous-token, duplicate-token and induction score (each (L, H)) under
    `definition` ("glassgpt", "arena" or "transformer_lens": the module's docstring says which
    cells each averages).

    Without `tokens`, `batch` random halves of `half` tokens (seeded), each written twice. With
    `tokens` (B, p + 2n): your own, a prefix of p then a half of n written twice (ARENA's BOS +
    A + A: p = 1); `prefix` says p, else the shortest prefix after which they repeat is found. A
    model trained on text may copy only what looks like its text (a character model's words)."""
    hook_points(model)  # first: what is not a glassgpt model is refused before all else
    if definition not in DEFINITIONS:
        raise InputError(f"definition must be one of {', '.join(DEFINITIONS)}, got "
                         f"{definition!r:.40}")
    if tokens is None:
        if prefix is not None:
            raise InputError(f"prefix={prefix!r:.20} says where given tokens repeat; random "
                             "tokens have none: pass tokens= with the prefix")
        ids = random_repeats(model, half, batch, seed)
        prefix = 0
    else:
        prefix = check_repeated(tokens, model.config.block_size, prefix)
        ids = tokens
    half = (ids.shape[1] - prefix) // 2
    patterns = layer_patterns(model, ids)
    if definition == "transformer_lens":
        previous, duplicate, induction = transformer_lens_scores(patterns, ids.cpu())
    else:
        read = glassgpt_scores if definition == "glassgpt" else arena_scores
        per_layer = [read(pattern, half, prefix) for pattern in patterns]  # L of 3 (H,)
        previous, duplicate, induction = (torch.stack(scores).cpu()  # (L, H) each
                                          for scores in zip(*per_layer, strict=True))
    return HeadScores(previous, duplicate, induction, half, prefix, definition)


# --- TransformerLens's detect_head -------------------------------------------------------------

def detect_head(model: nn.Module, seq: Any, detection_pattern: str | Tensor,
                heads: Sequence[tuple[int, int]] | Mapping[int, Sequence[int]] | None = None,
                cache: Mapping[str, Tensor] | None = None, *, exclude_bos: bool = False,
                exclude_current_token: bool = False, error_measure: str = "mul") -> Tensor:
    """TransformerLens's `head_detector.detect_head`, its semantics on a glassgpt model:
    (L, H), each head's match to `detection_pattern`, -1 for the heads `heads` leaves out.

    seq: token ids (T,) or (B, T) (each row a sequence, the rows' scores averaged), a string
    when the model has `to_tokens`, or a list of these, each scored alone and averaged.
    detection_pattern: "previous_token_head" (1 at [i, i - 1]), "duplicate_token_head" (1 at
    each earlier copy of token i), "induction_head" (1 at the token after each earlier copy),
    built from each sequence's own tokens, or your own lower-triangular (T, T).
    heads: [(layer, head), ...] or {layer: [head, ...]}. cache: a run of `seq` (one sequence
    or batch, not a list), its patterns (B, H, T, T) or TransformerLens's (H, T, T).
    error_measure "mul": the share of the head's attention on the pattern's cells (what
    exclude_bos / exclude_current_token leave of it); "abs": 1 - sum |pattern - detection| / T,
    rounded to 3 decimals. Unlike TransformerLens a sequence may fill the whole block_size."""
    hook_points(model)
    if error_measure not in ERROR_MEASURES:
        raise InputError(f"error_measure must be one of {', '.join(ERROR_MEASURES)}, got "
                         f"{error_measure!r:.40}")
    groups = sequences_of(model, seq)
    if cache is not None and isinstance(seq, list | tuple):
        raise InputError("one cache holds one run: pass cache only with one sequence or batch, "
                         "not a list")
    kind = check_detection_pattern(detection_pattern, groups, error_measure)
    chosen = selected_heads(heads, model.config.n_layer, model.config.n_head)
    options = dict(exclude_bos=exclude_bos, exclude_current_token=exclude_current_token,
                   error_measure=error_measure)
    found = []
    for ids in groups:
        patterns = layer_patterns(model, ids) if cache is None \
            else cached_patterns(cache, model, ids)
        found.append(detection_scores(patterns, ids, kind, **options))
    scores = torch.stack(found).mean(dim=0)  # (L, H)
    matches = torch.full_like(scores, -1.0)
    matches[chosen] = scores[chosen]
    return matches


def sequences_of(model: nn.Module, seq: Any) -> list[Tensor]:
    """seq -> its groups of token ids, each (B, T): a list is one group per element."""
    if isinstance(seq, list | tuple):
        if not seq:
            raise InputError("seq is an empty list: pass at least one sequence")
        return [one_sequence(model, s) for s in seq]
    return [one_sequence(model, seq)]


def one_sequence(model: nn.Module, seq: Any) -> Tensor:
    if isinstance(seq, str):
        to_tokens = getattr(model, "to_tokens", None)
        if to_tokens is None:
            raise InputError(f"seq {seq!r:.30} is text, but {type(model).__name__} has no "
                             "to_tokens: pass token ids (T,) or (B, T)")
        seq = to_tokens(seq)
    if isinstance(seq, Tensor) and seq.dim() == 1:
        seq = seq.unsqueeze(0)  # (T,) -> (1, T)
    check_run_ids(seq)
    if not 2 <= seq.shape[1] <= model.config.block_size:
        raise InputError(f"a sequence must hold 2..block_size = {model.config.block_size} "
                         f"tokens, got shape {tuple(seq.shape)}")
    return seq


def check_detection_pattern(pattern: object, groups: list[Tensor],
                            error_measure: str) -> str | Tensor:
    """A kind's name, or a lower-triangular (T, T) as long as every sequence."""
    if isinstance(pattern, str):
        if pattern not in HEAD_KINDS:
            raise InputError(f"detection_pattern must be a (T, T) tensor or one of "
                             f"{', '.join(HEAD_KINDS)}, got {pattern!r:.40}")
        return pattern
    lengths = sorted({ids.shape[1] for ids in groups})
    if not isinstance(pattern, Tensor) or len(lengths) > 1 \
            or tuple(pattern.shape) != (lengths[0], lengths[0]):
        shape = tuple(pattern.shape) if isinstance(pattern, Tensor) else type(pattern).__name__
        raise InputError(f"detection_pattern must be (T, T) for sequences of T = "
                         f"{', '.join(map(str, lengths))} tokens (one T), got {shape}")
    pattern = pattern.float()
    if not torch.equal(pattern, pattern.tril()):
        raise InputError("detection_pattern must be lower triangular: a query cannot attend "
                         "to a later key")
    if error_measure == "mul" and not set(pattern.unique().tolist()) <= {0.0, 1.0}:
        warnings.warn("a detection pattern of values other than 0 and 1 with "
                      "error_measure='mul' weighs cells, it does not predict them: 'abs' does",
                      stacklevel=3)
    return pattern


def selected_heads(heads: object, n_layer: int, n_head: int) -> tuple[list[int], list[int]]:
    """heads (None: all; [(layer, head)]; {layer: [head]}) -> (layers, heads) to index (L, H)."""
    if heads is None:
        pairs = [(layer, head) for layer in range(n_layer) for head in range(n_head)]
    elif isinstance(heads, Mapping):
        pairs = [(layer, head) for layer, chosen in heads.items() for head in chosen]
    elif isinstance(heads, list | tuple):
        pairs = list(heads)
    else:
        raise InputError(f"heads must be [(layer, head), ...] or {{layer: [head, ...]}}, got "
                         f"{type(heads).__name__}")
    for pair in pairs:
        if not (isinstance(pair, tuple | list) and len(pair) == 2):
            raise InputError(f"heads must be (layer, head) pairs, got {pair!r:.40}")
    return ([checks.index("layer", layer, n_layer) for layer, _ in pairs],
            [checks.index("head", head, n_head) for _, head in pairs])


def cached_patterns(cache: Mapping[str, Tensor], model: nn.Module, ids: Tensor) -> list[Tensor]:
    """Every layer's pattern (B, H, T, T) from a cache of this model's run of ids."""
    if not isinstance(cache, Mapping):
        raise InputError(f"cache must be a run_with_cache cache, got {type(cache).__name__}")
    if isinstance(cache, ActivationCache) and cache.ids is not None:
        if cache.model is not None and as_glass(cache.model) is not as_glass(model):
            raise InputError("the cache was made by another model: pass cache=None or this "
                             "model's run of seq")
        if not torch.equal(cache.ids.cpu(), ids.cpu()):
            raise InputError(f"the cache is a run of other token ids {tuple(cache.ids.shape)} "
                             f"than seq {tuple(ids.shape)}: pass the ids it was made from")
    want = (ids.shape[0], model.config.n_head, ids.shape[1], ids.shape[1])
    patterns = []
    for layer in range(model.config.n_layer):
        pattern = cached(cache, f"blocks.{layer}.attn.hook_pattern")
        if pattern.dim() == 3:
            pattern = pattern.unsqueeze(0)  # TransformerLens's remove_batch_dim: (H, T, T)
        if tuple(pattern.shape) != want:
            raise InputError(f"the cache's blocks.{layer}.attn.hook_pattern is "
                             f"{tuple(pattern.shape)}, but seq makes {want}")
        patterns.append(pattern.float())
    return patterns
