"""What `glassgpt view` shows of a run, as JSON-ready values. No web code lives here.

`RunView` holds a loaded model and its tokenizer and answers the page's questions: the tokens of
a prompt, the attention of a layer (weights or the scores before the softmax), of every layer and
head at once, or of one token, one query token through one head step by step ("Inside one
head"), the top-k next tokens and logit lens at every position (and what sampling draws from at
a temperature and top-k), the same with heads or layers switched off ("Ablation"), a streamed
sample, and the model card. User mistakes (an empty prompt, characters the
tokenizer lacks, a layer that does not exist) raise `glassgpt.errors` exceptions with one-line
messages; the server turns those into 4xx answers.

One forward pass per prompt gives both the attention maps and the logit lens; the last few are
kept (`TraceCache`, glassgpt.view.traces), so switching layers or heads on the page does not run
the model again. The maps are drawn by glassgpt.view.maps, the card's parts by
glassgpt.view.card. Notation: L = layers, H = heads, T = prompt tokens, k = top tokens kept.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from glassgpt.config import SamplingConfig
from glassgpt.data import PreparedData, default_data_dir
from glassgpt.decoding.generate import encode_prompt, stream_text
from glassgpt.decoding.sampling import (
    DEFAULT_TEMPERATURE,
    DEFAULT_TOP_K,
    DEFAULT_TOP_P,
    check_filter,
    sampling_distribution,
)
from glassgpt.errors import GlassGPTError, InputError
from glassgpt.interp.core.checks import integer
from glassgpt.interp.methods.lens import (
    Ablation,
    TopK,
    hidden_keys,
    lens_top_k,
    prompt_loss,
    read_out,
    trace,
)
from glassgpt.model import GPT, count_parameters
from glassgpt.rundir.checkpoint import read_run_config
from glassgpt.tokenizers import Tokenizer, same_tokenizer
from glassgpt.view import causal, walk
from glassgpt.view.card import layer_kinds, parameter_counts, run_lora_card, training_card
from glassgpt.view.maps import lower_triangle, out_of_window, pooled, scale_of
from glassgpt.view.pieces import piece_text
from glassgpt.view.traces import Inside, TraceCache
from glassgpt.view.values import Prompt, rounded

MAX_PROMPT_CHARS = 20_000  # refused before tokenizing: longer than any context glassgpt trains
MAX_TOP_K = 20
MAX_NEW_TOKENS = 2_000
# The page starts with a piece of the run's own validation text, this many tokens long at most:
# short enough that every token of a map is labelled at the page's first zoom.
EXAMPLE_TOKENS = 32
# Without validation text the page starts with the first of these the tokenizer can encode.
EXAMPLE_PROMPTS = ("ROMEO:\nBut soft, what light through yonder window breaks?",
                   "To be, or not to be, that is the question", "to be or not to be")
THUMBNAIL_CELLS = 48  # an overview map of a longer prompt averages blocks of cells
ATTENTION_KINDS = ("weights", "scores")


def ablation_from(heads: list, attention: list, mlp: list) -> Ablation:
    """The page's switches as an `Ablation`: heads [[layer, head], ...], layers [l, ...]."""
    pairs = []
    for pair in heads:
        if not isinstance(pair, list) or len(pair) != 2:
            raise InputError(f"each of heads must be [layer, head], got {pair!r:.40}")
        pairs.append((integer("a layer", pair[0]), integer("a head", pair[1])))
    return Ablation(heads=pairs, attention=[integer("a layer", v) for v in attention],
                    mlp=[integer("a layer", v) for v in mlp])


def top_k_probabilities_of(probs: Tensor, k: int) -> TopK:
    """The k largest entries of probabilities (..., V): (..., k), most likely first."""
    values, ids = torch.topk(probs.float(), min(k, probs.shape[-1]), dim=-1)
    return TopK(values.cpu(), ids.cpu())


def check_index(what: str, value: int, size: int) -> None:
    if not 0 <= value < size:
        raise InputError(f"{what} {value} does not exist: the model has {what}s 0..{size - 1}")


class RunView:
    """A trained model seen through: the computations behind every panel of the page."""

    def __init__(self, model: GPT, tokenizer: Tokenizer, run_dir: Path | None = None,
                 name: str | None = None, threads: int | None = None,
                 checkpoint: str = "best"):
        self.model, self.tokenizer, self.run_dir = model.eval(), tokenizer, run_dir
        self.checkpoint = checkpoint  # which of the run's weights: "best", "last", "step:N"
        self.name = name or (run_dir.name if run_dir is not None else "model")
        self.device = model.lm_head.weight.device
        self.traces = TraceCache()
        # Callers on several threads asking about one prompt at once (the page asks for
        # attention and predictions together): the first computes, the others find it cached.
        self._computing = threading.Lock()
        self._card: dict[str, Any] | None = None
        self._scores: tuple[causal.ViewScores | None] | None = None  # once computed
        self.threads = threads  # the CPU threads it serves with (load_for_view chooses them)

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
        """A prompt to start the page with: a piece of the run's own validation text when its
        data directory is at hand, else a stock line the tokenizer encodes."""
        from_run = self._validation_excerpt()
        if from_run:
            return from_run
        for text in EXAMPLE_PROMPTS:
            text = text[:self.block_size]  # a token holds at least one character
            try:
                self.encode(text)
            except GlassGPTError:
                continue
            return text
        return ""

    def validation_ids(self) -> np.ndarray | None:
        """The ids of the validation split the run was trained against (its data directory
        from config.json; memory-mapped), or None when it is not at hand or was written by
        another tokenizer."""
        if self.run_dir is None:
            return None
        try:
            data_dir = read_run_config(self.run_dir).get("data_dir")
            data = PreparedData(data_dir if data_dir else default_data_dir())
            # A run with no data directory of its own (an imported model, say) was not trained
            # on the default data either unless it has that data's tokenizer: ids of another
            # tokenizer decode to garbage.
            if not same_tokenizer(data.tokenizer, self.tokenizer):
                return None
            return data.splits["val"]
        except (GlassGPTError, OSError, KeyError, TypeError, ValueError):
            return None

    def _validation_excerpt(self) -> str | None:
        """The first lines of the validation split the run was trained against, at most
        EXAMPLE_TOKENS tokens, cut at a line or a word."""
        split = self.validation_ids()
        if split is None:
            return None
        text = self.tokenizer.decode([int(i) for i in split[:4 * EXAMPLE_TOKENS]])
        if "\n" in text[:-1]:
            text = text[text.find("\n") + 1:].lstrip()  # begin at a line that has text
        most = min(EXAMPLE_TOKENS, self.block_size)
        head = self.tokenizer.decode(self.tokenizer.encode(text)[:most])
        whole_words = len(head) == len(text) or text[len(head)].isspace()
        cut = max(head.rfind(" "), head.rfind("\n"))  # else end at a word: never inside one
        piece = (head if whole_words or cut <= 0 else head[:cut]).rstrip()
        try:
            return piece if piece and len(self.encode(piece).ids) <= most else None
        except GlassGPTError:
            return None

    def token_text(self, token_id: int) -> str:
        return piece_text(self.tokenizer, token_id)

    def tokens(self, prompt: str) -> dict[str, Any]:
        encoded = self.encode(prompt)
        return {"tokens": [{"id": i, "text": self.token_text(i)} for i in encoded.ids],
                "block_size": self.block_size}

    # --- one forward pass, kept ----------------------------------------------------------------

    def inside(self, prompt: Prompt, ablation: Ablation | None = None) -> Inside:
        """Attention, logit lens and loss of `prompt`, from the cache or from one forward pass
        (with the parts of `ablation` switched off)."""
        key = (tuple(prompt.ids), ablation or None)
        found = self.traces.get(key)
        if found is not None:
            return found
        with self._computing:
            found = self.traces.get(key)
            if found is not None:
                return found
            seen = trace(self.model, prompt.idx, ablation)  # batch of one
            lens = lens_top_k(self.model, seen.residuals, MAX_TOP_K)[:, 0]  # (L + 1, T, k)
            inside = Inside(attention=seen.attention[:, 0].float().cpu(),  # (L, H, T, T)
                            scores=seen.scores[:, 0].float().cpu(),  # (L, H, T, T)
                            lens=TopK(lens.probs.float().cpu(), lens.ids.cpu()),
                            residuals=seen.residuals,
                            loss=prompt_loss(self.model, seen, prompt.idx))
            self.traces.put(key, inside)
            return inside

    # --- attention -------------------------------------------------------------------------

    def attention(self, prompt: str, layer: int, head: int | None = None,
                  kind: str = "weights") -> dict[str, Any]:
        """The attention of `layer`: one head, or all its heads (head None). Each map is sent
        as the rows of its lower triangle (row i: what token i attends to, keys 0..i); on a
        local layer the keys W or more back are None (hidden by the window, not weights of 0).
        kind "weights": after the softmax (rows sum to 1); "scores": q . k scaled, before it."""
        config = self.model.config
        check_index("layer", layer, config.n_layer)
        if head is not None:
            check_index("head", head, config.n_head)
        if kind not in ATTENTION_KINDS:
            raise InputError(f"kind must be one of {', '.join(ATTENTION_KINDS)}, got {kind!r:.40}")
        encoded = self.encode(prompt)
        inside = self.inside(encoded)
        maps = (inside.attention if kind == "weights" else inside.scores)[layer]  # (H, T, T)
        heads = list(range(config.n_head)) if head is None else [head]
        shown = maps[heads]  # (heads, T, T)
        window = self.model.blocks[layer].attn.window
        hidden = out_of_window(inside.scores[layer, 0])  # one mask serves every head
        return {"layer": layer, "heads": heads, "tokens": len(encoded.ids), "kind": kind,
                "attention": "global" if window is None else "local", "window": window,
                "kv_head_of": [self._kv_head(layer, h) for h in heads],
                "scale": {"min": 0.0, "max": 1.0} if kind == "weights" else scale_of(shown),
                "weights": [lower_triangle(maps[h], hidden) for h in heads]}

    def _kv_head(self, layer: int, head: int) -> int:
        attn = self.model.blocks[layer].attn
        return attn.kv_head_of(head)

    def overview(self, prompt: str) -> dict[str, Any]:
        """Every head of every layer at once, as thumbnails: weights[layer][head] is a map of
        at most THUMBNAIL_CELLS x THUMBNAIL_CELLS (a longer prompt's cells are averaged). A
        cell a local layer's window hides entirely is None."""
        encoded = self.encode(prompt)
        inside = self.inside(encoded)
        maps = pooled(inside.attention, THUMBNAIL_CELLS)  # (L, H, n, n)
        n, T = maps.shape[-1], len(encoded.ids)
        hidden = [out_of_window(scores[0], THUMBNAIL_CELLS) for scores in inside.scores]
        return {"tokens": T, "cells": n, "pooled": n < T,
                "weights": [[lower_triangle(head, gone) for head in layer]
                            for layer, gone in zip(maps, hidden, strict=True)],
                "scores": causal.scores_answer(self.head_scores())}

    def attends(self, prompt: str, position: int) -> dict[str, Any]:
        """What the token at `position` attends to in every head of every layer:
        weights[layer][head] over keys 0..position, None for a key a local layer's window hides."""
        encoded = self.encode(prompt)
        check_index("position", position, len(encoded.ids))
        inside = self.inside(encoded)
        weights = rounded(inside.attention[:, :, position, :position + 1])  # (L, H, p + 1)
        # The keys each layer hid from this query (one mask serves every head): (L, p + 1)
        hidden = hidden_keys(inside.scores[:, 0, position, :position + 1]).tolist()
        for heads, gone in zip(weights, hidden, strict=True):
            for row in heads:
                row[:] = [None if out else value for value, out in zip(row, gone, strict=True)]
        return {"position": position, "weights": weights}

    # --- inside one head ---------------------------------------------------------------------

    def head(self, prompt: str, layer: int, head: int, position: int) -> dict[str, Any]:
        """One query token through one head, step by step, with the model's numbers: each step
        has its name, shape, values and the line of attention.py / block.py computing it
        (`glassgpt.view.walk`)."""
        config = self.model.config
        check_index("layer", layer, config.n_layer)
        check_index("head", head, config.n_head)
        check_index("position", position, len(self.encode(prompt).ids))
        return walk.head_answer(self, prompt, layer, head, position)

    # --- why: patching, attribution, head scores, the MLP (glassgpt.view.causal) --------------

    def patching(self, clean: str, corrupted: str | None = None, answer: int | None = None,
                 wrong: int | None = None, progress: causal.OnPass | None = None
                 ) -> dict[str, Any]:
        """Activation patching of `corrupted` (None: the clean prompt with one token changed)
        from `clean`, normalised: 0 = the corrupted run, 1 = the clean one. `progress(done,
        total)` hears of each forward pass."""
        return causal.patching(self, clean, corrupted, answer, wrong, progress)

    def attribution(self, prompt: str, position: int, token: int | None = None,
                    against: int | None = None) -> dict[str, Any]:
        """Each head's and MLP's direct push on `token`'s logit at `position` (minus
        `against`'s)."""
        return causal.attribution(self, prompt, position, token, against)

    def mlp(self, prompt: str, layer: int, position: int) -> dict[str, Any]:
        """The token at `position` through the MLP of `layer`, step by step."""
        return causal.mlp(self, prompt, layer, position)

    def head_scores(self) -> causal.ViewScores | None:
        """Every head's previous-token, duplicate-token and induction scores on windows of
        the run's validation text repeated (random tokens without it), computed once for this
        model (None: a context too short to repeat a sequence in)."""
        with self._computing:
            if self._scores is None:
                self._scores = (causal.scores_of(self.model, self.validation_ids()),)
            return self._scores[0]

    # --- predictions and the logit lens ------------------------------------------------------

    def predictions(self, prompt: str, k: int = 5, temperature: float = DEFAULT_TEMPERATURE,
                    top_k: int | None = DEFAULT_TOP_K, top_p: float | None = DEFAULT_TOP_P
                    ) -> dict[str, Any]:
        """The top-k next tokens at every position, read out after the embeddings and after
        each layer (the logit lens). The last row is the model's own prediction; `sampling`
        is what `glassgpt sample` draws from at that temperature, top-k and top-p."""
        self._check_k(k)
        check_filter(temperature, top_k, top_p)
        encoded = self.encode(prompt)
        inside = self.inside(encoded)
        if (temperature, top_k, top_p) == (1, None, None):  # the model's own: kept
            drawn = TopK(inside.lens.probs[-1, :, :k], inside.lens.ids[-1, :, :k])
        else:
            logits = read_out(self.model, inside.residuals[-1][0])  # (T, V)
            reshaped = sampling_distribution(logits, temperature, top_k, top_p)  # (T, V)
            drawn = top_k_probabilities_of(reshaped, k)  # (T, k)
        answer = self._lens_answer(inside, k, extra_ids=drawn.ids)
        answer["sampling"] = {"temperature": temperature, "top_k": top_k, "top_p": top_p,
                              "ids": drawn.ids.tolist(), "probs": rounded(drawn.probs)}
        return answer

    def ablate(self, prompt: str, k: int = 5, heads: list | tuple = (),
               attention: list | tuple = (), mlp: list | tuple = ()) -> dict[str, Any]:
        """The intact model beside the model with `heads` ([layer, head] pairs) and whole layers'
        `attention` or `mlp` switched off: top-k and logit lens at every position, and the loss
        on the prompt, for each."""
        self._check_k(k)
        ablation = ablation_from(list(heads), list(attention), list(mlp))
        ablation.check(self.model)
        encoded = self.encode(prompt)
        intact, changed = self.inside(encoded), self.inside(encoded, ablation)
        both = [self._lens_answer(intact, k), self._lens_answer(changed, k)]
        pieces = {**both[0].pop("pieces"), **both[1].pop("pieces")}
        return {"k": k, "layers": both[0].pop("layers"), "pieces": pieces,
                "ablation": {"heads": sorted([l, h] for l, h in ablation.heads),
                             "attention": sorted(ablation.attention),
                             "mlp": sorted(ablation.mlp)},
                "intact": {**both[0], "loss": intact.loss},
                "ablated": {**both[1], "loss": changed.loss}}

    def _lens_answer(self, inside: Inside, k: int, extra_ids: Tensor | None = None
                     ) -> dict[str, Any]:
        ids = inside.lens.ids[..., :k]  # (L + 1, T, k)
        named = set(ids.flatten().tolist())
        if extra_ids is not None:
            named |= set(extra_ids.flatten().tolist())
        pieces = {str(i): self.token_text(i) for i in sorted(named)}
        layers = ["embeddings", *(f"layer {i}" for i in range(self.model.config.n_layer))]
        return {"k": k, "layers": layers, "ids": ids.tolist(),
                "probs": rounded(inside.lens.probs[..., :k]), "pieces": pieces}

    @staticmethod
    def _check_k(k: int) -> None:
        if not 1 <= integer("k", k) <= MAX_TOP_K:
            raise InputError(f"k must be between 1 and {MAX_TOP_K}, got {k}")

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
                "layers": layer_kinds(self.model),  # local (a window of W keys) or global
                "tokenizer": {"kind": self.tokenizer.kind,
                              "vocab_size": self.tokenizer.vocab_size},
                "parameters": {"total": count_parameters(self.model),
                               "parts": parameter_counts(self.model)},
                "training": training_card(self.run_dir), "lora": run_lora_card(self.run_dir)}
