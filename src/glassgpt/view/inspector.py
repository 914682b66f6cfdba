"""What `glassgpt view` shows of a run, as JSON-ready values. No web code lives here.

`RunView` holds a loaded model and its tokenizer and answers the page's questions: the tokens of
a prompt, the attention of a layer or of one token, the top-k next tokens and logit lens at every
position, a streamed sample, and the model card. User mistakes (an empty prompt, characters the
tokenizer lacks, a layer that does not exist) raise `glassgpt.errors` exceptions with one-line
messages; the server turns those into 4xx answers.

One forward pass per prompt gives both the attention maps and the logit lens; the last few are
kept (`TraceCache`), so switching layers or heads on the page does not run the model again.
Notation: L = layers, H = heads, T = prompt tokens, k = top tokens kept.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import Tensor

from glassgpt.checkpoint import read_run_config
from glassgpt.config import SamplingConfig
from glassgpt.errors import CheckpointError, GlassGPTError, InputError
from glassgpt.generate import encode_prompt, stream_text
from glassgpt.lens import TopK, lens_top_k, parameter_counts, trace
from glassgpt.metrics import read_metrics
from glassgpt.model import GPT, count_parameters
from glassgpt.tokenizers import Tokenizer

MAX_PROMPT_CHARS = 20_000  # refused before tokenizing: longer than any context glassgpt trains
MAX_TOP_K = 20
MAX_NEW_TOKENS = 2_000
CURVE_POINTS = 500  # training-loss points sent for the card's curve (evaluations all kept)
TRACE_CACHE_BYTES = 256 * 2**20
DECIMALS = 4  # probabilities and attention weights are sent rounded to this many places
# The page starts with the first of these that the tokenizer can encode.
EXAMPLE_PROMPTS = ("ROMEO:\nBut soft, what light through yonder window breaks?",
                   "To be, or not to be, that is the question", "to be or not to be")


@dataclass(frozen=True)
class Prompt:
    """A prompt as the model sees it."""

    text: str
    ids: list[int]
    idx: Tensor  # (1, T)


@dataclass(frozen=True)
class Inside:
    """What one forward pass over a prompt showed: kept for the page's next questions."""

    attention: Tensor  # (L, H, T, T)
    lens: TopK  # (L + 1, T, MAX_TOP_K): after the embeddings, then after each layer

    @property
    def nbytes(self) -> int:
        tensors = (self.attention, self.lens.probs, self.lens.ids)
        return sum(t.numel() * t.element_size() for t in tensors)


class TraceCache:
    """The `Inside` of the most recent prompts, by token ids, within a byte budget."""

    def __init__(self, budget_bytes: int = TRACE_CACHE_BYTES):
        self.budget = budget_bytes
        self.entries: OrderedDict[tuple[int, ...], Inside] = OrderedDict()
        self.lock = threading.Lock()  # the server asks from several threads

    def get(self, key: tuple[int, ...]) -> Inside | None:
        with self.lock:
            if key in self.entries:
                self.entries.move_to_end(key)
            return self.entries.get(key)

    def put(self, key: tuple[int, ...], inside: Inside) -> None:
        with self.lock:
            self.entries[key] = inside
            self.entries.move_to_end(key)
            # The newest entry stays even over budget: it is the one being looked at.
            while len(self.entries) > 1 and self._total() > self.budget:
                self.entries.popitem(last=False)

    def _total(self) -> int:
        return sum(inside.nbytes for inside in self.entries.values())


def rounded(values: Tensor) -> Any:
    """A tensor as nested lists of floats with DECIMALS places (short JSON)."""
    return values.double().mul(10**DECIMALS).round().div(10**DECIMALS).tolist()


def lower_triangle(weights: Tensor) -> list[list[float]]:
    """Causal attention (T, T) as its rows up to the diagonal: row i has i + 1 weights."""
    return [row[:i + 1] for i, row in enumerate(rounded(weights))]


def check_index(what: str, value: int, size: int) -> None:
    if not 0 <= value < size:
        raise InputError(f"{what} {value} does not exist: the model has {what}s 0..{size - 1}")


class RunView:
    """A trained model seen through: the computations behind every panel of the page."""

    def __init__(self, model: GPT, tokenizer: Tokenizer, run_dir: Path | None = None,
                 name: str | None = None):
        self.model, self.tokenizer, self.run_dir = model.eval(), tokenizer, run_dir
        self.name = name or (run_dir.name if run_dir is not None else "model")
        self.device = model.lm_head.weight.device
        self.traces = TraceCache()
        # Callers on several threads asking about one prompt at once (the page asks for
        # attention and predictions together): the first computes, the others find it cached.
        self._computing = threading.Lock()
        self._card: dict[str, Any] | None = None

    @property
    def block_size(self) -> int:
        return self.model.config.block_size

    # --- prompts and tokens ------------------------------------------------------------------

    def encode(self, text: str) -> Prompt:
        """`text` encoded; InputError/TokenizerError for empty, unknown characters, too long."""
        if len(text) > MAX_PROMPT_CHARS:
            raise InputError(f"the prompt has {len(text):,} characters; the most this page "
                             f"takes is {MAX_PROMPT_CHARS:,}")
        if not text:
            raise InputError("the prompt is empty; type some text")
        idx, length = encode_prompt(self.tokenizer, text, self.block_size, self.device)
        if length > self.block_size:
            raise InputError(f"the prompt is {length} tokens long; the model's context holds "
                             f"{self.block_size}")
        return Prompt(text, idx[0].tolist(), idx)

    def example_prompt(self) -> str:
        """A prompt to start the page with: one the tokenizer encodes, within the context."""
        for text in EXAMPLE_PROMPTS:
            text = text[:self.block_size]  # a token holds at least one character
            try:
                self.encode(text)
            except GlassGPTError:
                continue
            return text
        return ""

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def tokens(self, prompt: str) -> dict[str, Any]:
        encoded = self.encode(prompt)
        return {"tokens": [{"id": i, "text": self.token_text(i)} for i in encoded.ids],
                "block_size": self.block_size}

    # --- one forward pass, kept ----------------------------------------------------------------

    def inside(self, prompt: Prompt) -> Inside:
        """Attention and logit lens of `prompt`, from the cache or from one forward pass."""
        key = tuple(prompt.ids)
        found = self.traces.get(key)
        if found is not None:
            return found
        with self._computing:
            found = self.traces.get(key)
            if found is not None:
                return found
            seen = trace(self.model, prompt.idx)  # batch of one
            lens = lens_top_k(self.model, seen.residuals, MAX_TOP_K)[:, 0]  # (L + 1, T, k)
            inside = Inside(attention=seen.attention[:, 0].float().cpu(),  # (L, H, T, T)
                            lens=TopK(lens.probs.float().cpu(), lens.ids.cpu()))
            self.traces.put(key, inside)
            return inside

    # --- attention -------------------------------------------------------------------------

    def attention(self, prompt: str, layer: int, head: int | None = None) -> dict[str, Any]:
        """The attention of `layer`: one head, or all its heads (head None). Each map is sent
        as the rows of its lower triangle (row i: what token i attends to, keys 0..i)."""
        config = self.model.config
        check_index("layer", layer, config.n_layer)
        if head is not None:
            check_index("head", head, config.n_head)
        encoded = self.encode(prompt)
        maps = self.inside(encoded).attention[layer]  # (H, T, T)
        heads = list(range(config.n_head)) if head is None else [head]
        return {"layer": layer, "heads": heads, "tokens": len(encoded.ids),
                "weights": [lower_triangle(maps[h]) for h in heads]}

    def attends(self, prompt: str, position: int) -> dict[str, Any]:
        """What the token at `position` attends to in every head of every layer:
        weights[layer][head] over keys 0..position."""
        encoded = self.encode(prompt)
        check_index("position", position, len(encoded.ids))
        rows = self.inside(encoded).attention[:, :, position, :position + 1]  # (L, H, p + 1)
        return {"position": position, "weights": rounded(rows)}

    # --- predictions and the logit lens ------------------------------------------------------

    def predictions(self, prompt: str, k: int = 5) -> dict[str, Any]:
        """The top-k next tokens at every position, read out after the embeddings and after
        each layer (the logit lens). The last row is the model's own prediction."""
        if not 1 <= k <= MAX_TOP_K:
            raise InputError(f"k must be between 1 and {MAX_TOP_K}, got {k}")
        encoded = self.encode(prompt)
        lens = self.inside(encoded).lens  # (L + 1, T, MAX_TOP_K)
        ids = lens.ids[..., :k]  # (L + 1, T, k)
        pieces = {str(i): self.token_text(i) for i in sorted(set(ids.flatten().tolist()))}
        layers = ["embeddings", *(f"layer {i}" for i in range(self.model.config.n_layer))]
        return {"k": k, "layers": layers, "ids": ids.tolist(),
                "probs": rounded(lens.probs[..., :k]), "pieces": pieces}

    # --- sampling --------------------------------------------------------------------------

    def sample(self, prompt: str, sampling: SamplingConfig) -> Iterator[str]:
        """The continuation of `prompt`, piece by piece, by `glassgpt sample`'s decoding code.
        Checks the prompt and settings now, before the first piece is asked for."""
        if sampling.max_new_tokens > MAX_NEW_TOKENS:
            raise InputError(f"max_new_tokens must be at most {MAX_NEW_TOKENS:,} here, got "
                             f"{sampling.max_new_tokens:,}")
        encoded = self.encode(prompt)
        return stream_text(self.model, self.tokenizer, encoded.idx, sampling)

    # --- the model card ----------------------------------------------------------------------

    def card(self) -> dict[str, Any]:
        if self._card is None:
            self._card = self._build_card()
        return self._card

    def _build_card(self) -> dict[str, Any]:
        config = self.model.config
        return {"name": self.name, "example_prompt": self.example_prompt(),
                "model": config.to_dict(),
                "tokenizer": {"kind": self.tokenizer.kind,
                              "vocab_size": self.tokenizer.vocab_size},
                "parameters": {"total": count_parameters(self.model),
                               "parts": parameter_counts(self.model)},
                "training": self._training()}

    def _training(self) -> dict[str, Any]:
        """Settings from config.json and the curve from metrics.jsonl (both in the run)."""
        if self.run_dir is None:
            return {"settings": None, "iterations": None, "best_val_loss": None,
                    "best_val_iter": None, "train": [], "eval": []}
        records = read_metrics(self.run_dir)
        steps = [[r["iter"], r["loss"]] for r in records if _is_number(r.get("loss"))]
        evals = [[r["iter"], r["train_loss"], r["val_loss"]] for r in records
                 if _is_number(r.get("train_loss")) and _is_number(r.get("val_loss"))]
        # The run keeps best weights from its first evaluation after step 0 on.
        best = min((e for e in evals if e[0] > 0), key=lambda e: e[2], default=None)
        return {"settings": self._train_settings(),
                "iterations": max((r["iter"] for r in records), default=None),
                "best_val_loss": best[2] if best else None,
                "best_val_iter": best[0] if best else None,
                "train": thin(steps, CURVE_POINTS), "eval": evals}

    def _train_settings(self) -> dict[str, Any] | None:
        try:
            return read_run_config(self.run_dir).get("train")
        except CheckpointError:
            return None


def _is_number(value: Any) -> bool:
    """A finite int or float (metrics.jsonl is written by the trainer, but read with care)."""
    return isinstance(value, int | float) and not isinstance(value, bool) \
        and math.isfinite(value)


def thin(points: list[list[float]], most: int) -> list[list[float]]:
    """At most `most` of `points`, evenly spread, always keeping the last one."""
    if len(points) <= most:
        return points
    step = len(points) / most
    kept = [points[int(i * step)] for i in range(most - 1)]
    return [*kept, points[-1]]
