"""The page's questions of *why*, as JSON-ready values: activation patching, direct logit
attribution, each head's previous-token and induction scores, and the walk inside one MLP.

The numbers are `glassgpt.interp`'s (TransformerLens's names and functions), run on the model
of the viewed run (`values.View`; `inspector.RunView` is one): nothing is recomputed here in a
second way. User mistakes (prompts of different lengths, an answer token the tokenizer lacks,
too much work for one request, a Post-LN model asked for attribution) raise `glassgpt.errors`
exceptions with one-line messages.
Notation: L = layers, H = heads, T = prompt tokens, C = width, F = the MLP's hidden width.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from glassgpt.block import SwiGLUFeedForward
from glassgpt.errors import GlassGPTError, InputError
from glassgpt.hooks import lens_name
from glassgpt.interp.core import checks
from glassgpt.interp.core.hooked import run_with_cache
from glassgpt.interp.core.utils import get_act_name
from glassgpt.interp.methods import patching as patch
from glassgpt.interp.methods.attribution import logit_attribution
from glassgpt.interp.methods.heads import block_sources
from glassgpt.interp.methods.scores import HeadScores, head_scores
from glassgpt.model import count_parameters
from glassgpt.view.values import Prompt, View, rounded, step_answer

# One patching request runs the model once per cell of its four maps (3 L T + L H runs): more
# than this many is refused rather than keeping the page (and the model thread) busy for long.
MAX_PATCH_RUNS = 4096
CANDIDATES = 10  # answer tokens offered: the top of the clean and of the corrupted prediction
# Head scores on sequences of 2 x this many tokens at most (the context's half when it is
# shorter), a half then the same half again: enough positions for a steady mean, little memory
# for patterns.
SCORE_HALF = 32
ATTRIBUTION_SHOWN = 20  # the page shows the largest pushes first, this many until asked for all
TRIES = 64  # replacement tokens tried when making the default corrupted prompt


# --- activation patching -----------------------------------------------------------------------

def default_corruption(view: View, clean: Prompt) -> str:
    """The clean prompt with its next-to-last token replaced (by another token of the prompt,
    else a neighbouring id) such that the text encodes back to as many tokens: the answer
    at the last position then depends on a token the model has to carry forward."""
    ids = clean.ids
    at = max(0, len(ids) - 2)
    others = [i for i in dict.fromkeys(ids) if i != ids[at]]
    neighbours = [(ids[at] + step) % view.model.config.vocab_size for step in range(1, TRIES)]
    for token in [*others, *neighbours][:TRIES]:
        changed = [*ids[:at], token, *ids[at + 1:]]
        text = view.tokenizer.decode(changed)
        try:
            if text != clean.text and view.encode(text).ids == changed:
                return text
        except GlassGPTError:
            continue
    raise InputError("found no one-token change of the clean prompt that encodes back to as "
                     "many tokens; type a corrupted prompt")


def top_tokens(view: View, logits: Tensor, k: int) -> list[int]:
    """The k most likely ids of logits (V,) that the tokenizer has (a model's vocabulary may
    be padded past the tokenizer's)."""
    known = logits[:view.tokenizer.vocab_size]
    return torch.topk(known, min(k, known.shape[-1])).indices.tolist()


def check_token(view: View, what: str, token: int) -> int:
    vocab = view.tokenizer.vocab_size
    if not 0 <= token < vocab:
        raise InputError(f"{what} {token} is no token: the tokenizer has ids 0..{vocab - 1}")
    return token


def _answer_ids(view: View, clean_logits: Tensor, corrupted_logits: Tensor,
                answer: int | None, wrong: int | None) -> tuple[int, int]:
    """The clean answer (default: the clean run's top token at the last position) and the
    corrupted one (default: the corrupted run's top token, or the clean run's second)."""
    clean_top = top_tokens(view, clean_logits[0, -1], 2)
    if answer is None:
        answer = clean_top[0]
    if wrong is None:
        wrong = top_tokens(view, corrupted_logits[0, -1], 1)[0]
        if wrong == answer:
            wrong = clean_top[1] if clean_top[0] == answer else clean_top[0]
    check_token(view, "answer", answer)
    check_token(view, "wrong", wrong)
    if answer == wrong:
        raise InputError(f"the answer and the wrong token are both {answer}: patching compares "
                         "two different tokens")
    return answer, wrong


def _check_same_length(clean: Prompt, corrupted: Prompt) -> None:
    if len(clean.ids) != len(corrupted.ids):
        raise InputError(f"the clean prompt is {len(clean.ids)} tokens long and the corrupted "
                         f"one {len(corrupted.ids)}: patching needs prompts of the same length")


def _check_work(view: View, tokens: int) -> int:
    """The forward passes patching `tokens` tokens takes; InputError past MAX_PATCH_RUNS."""
    L, H = view.model.config.n_layer, view.model.blocks[0].attn.n_heads
    runs = len(_layer_maps(view)) * L * tokens + L * H
    if runs > MAX_PATCH_RUNS:
        raise InputError(f"patching {tokens} tokens through {L} layers takes {runs:,} forward "
                         f"passes; this page runs at most {MAX_PATCH_RUNS:,}: use a shorter "
                         "prompt")
    return runs


OnPass = Callable[[int, int], None]  # progress(done, total) after each forward pass


class PassCount:
    """One `progress(done, total)` over the four patching maps, each of which counts its own
    passes from 1 to its size: their sum, against every map's passes together."""

    def __init__(self, progress: OnPass, total: int):
        self.progress, self.total, self.before = progress, total, 0
        progress(0, total)  # the total is known before the first pass: the page can say it

    def __call__(self, done: int, size: int) -> None:
        self.progress(self.before + done, self.total)
        if done == size:
            self.before += size


def patching_warnings(view: View, clean: float, corrupted: float, answer: int,
                      wrong: int) -> list[str]:
    """What makes the maps hard to read, in words: patching reads "1 = clean, 0 = corrupted"
    on the logit difference d = logit(answer) - logit(wrong), and means it when the clean run
    prefers the answer (d > 0) and the corrupted one does not (d < 0)."""
    a, w = (repr(view.token_text(i)) for i in (answer, wrong))
    if clean <= corrupted:
        return [f"the corrupted prompt favours {a} over {w} more than the clean one does "
                f"(logit difference {corrupted:.3f} against {clean:.3f}): the normaliser "
                "clean - corrupted is negative, so a place that restores the clean answer reads "
                "below 0 and one that pushes away from it above 0; choose a corruption that "
                "flips the answer"]
    notes = []
    if clean < 0:
        notes.append(f"the clean prompt prefers {w} to {a} (logit difference {clean:.3f}): "
                     "the 'clean answer' is not the clean run's answer")
    if corrupted > 0:
        notes.append(f"the corrupted prompt does not flip the answer: it still prefers {a} to "
                     f"{w} (logit difference {corrupted:.3f} > 0); the maps show which places "
                     "restore a small change")
    return notes


def patching(view: View, clean: str, corrupted: str | None = None,
             answer: int | None = None, wrong: int | None = None,
             progress: OnPass | None = None) -> dict[str, Any]:
    """Activation patching of the corrupted prompt from the clean one: for each layer and
    position (the residual stream entering the block, the attention's and the MLP's output)
    and each layer and head (its output at every position), the normalised logit difference
    of `answer` over `wrong` at the last position: 0 = the corrupted run, 1 = the clean run.
    `progress(done, total)` hears of every patched forward pass (first with done 0)."""
    model = view.model
    clean_p = view.encode(clean)
    corrupted_p = view.encode(corrupted if corrupted else default_corruption(view, clean_p))
    _check_same_length(clean_p, corrupted_p)
    runs = _check_work(view, len(clean_p.ids))
    L = model.config.n_layer
    kinds = (*_layer_maps(view), "z")
    names = [get_act_name(kind, layer) for kind in kinds for layer in range(L)]
    clean_logits, clean_cache = run_with_cache(model, clean_p.idx, names=names)
    corrupted_logits, _ = run_with_cache(model, corrupted_p.idx, names=[])
    answer, wrong = _answer_ids(view, clean_logits, corrupted_logits, answer, wrong)
    metric = patch.normalized_logit_diff(clean_logits, corrupted_logits, answer, wrong)
    run = (model, corrupted_p.idx, clean_cache, metric)
    count = {"progress": PassCount(progress, runs)} if progress is not None else {}
    sweeps = {"resid_pre": patch.get_act_patch_resid_pre, "attn_out": patch.get_act_patch_attn_out,
              "mlp_out": patch.get_act_patch_mlp_out}
    maps = {kind: sweeps[kind](*run, **count) for kind in _layer_maps(view)}
    maps["heads"] = patch.get_act_patch_attn_head_out_all_pos(*run, **count)
    tops = [i for logits in (clean_logits, corrupted_logits)
            for i in top_tokens(view, logits[0, -1], CANDIDATES)]
    candidates = list(dict.fromkeys([answer, wrong, *tops]))
    diffs = {"clean": float(patch.logit_diff(clean_logits, answer, wrong)),
             "corrupted": float(patch.logit_diff(corrupted_logits, answer, wrong))}
    return {"clean": _prompt_answer(view, clean_p), "corrupted": _prompt_answer(view, corrupted_p),
            "answer": _token(view, answer), "wrong": _token(view, wrong),
            "logit_diff": diffs, "passes": runs,
            "warnings": patching_warnings(view, diffs["clean"], diffs["corrupted"], answer, wrong),
            "candidates": [_token(view, i) for i in candidates],
            **{name: rounded(values) for name, values in maps.items()}}


def _layer_maps(view: View) -> tuple[str, ...]:
    """The layer x position maps patching draws: no MLP output in an attention-only model."""
    has_mlp = view.model.blocks[0].ffn is not None
    return ("resid_pre", "attn_out", "mlp_out") if has_mlp else ("resid_pre", "attn_out")


def _prompt_answer(view: View, prompt: Prompt) -> dict[str, Any]:
    return {"text": prompt.text, "tokens": [_token(view, i) for i in prompt.ids]}


def _token(view: View, token_id: int) -> dict[str, Any]:
    return {"id": token_id, "text": view.token_text(token_id)}


# --- direct logit attribution ------------------------------------------------------------------

def attribution(view: View, prompt: str, position: int, token: int | None = None,
                against: int | None = None) -> dict[str, Any]:
    """Each head's, MLP's, embedding's and bias's direct push on `token`'s logit at `position`
    (default token: the model's top prediction there), or on its logit minus `against`'s; the
    parts add up to that logit (difference). `order`: the parts' indices, largest push (either
    sign) first."""
    encoded = view.encode(prompt)
    checks.index("position", position, len(encoded.ids))
    n_layer = view.model.config.n_layer
    # One pass serves both the candidates and the attribution.
    stream, cache = run_with_cache(view.model, encoded.idx, stop_at_layer=n_layer)
    with torch.no_grad():  # the logits of one position, not of all T: (V,)
        logits = view.model.read_out(stream[0, position])
    shown = top_tokens(view, logits, CANDIDATES)
    token = shown[0] if token is None else check_token(view, "token", token)
    if against is not None:
        check_token(view, "against", against)
        if against == token:
            raise InputError(f"token and against are both {token}: attribution against a "
                             "token compares two different tokens")
    with torch.no_grad():
        found = logit_attribution(view.model, encoded.idx, token, pos=position, cache=cache,
                                  against=against)
    values = found.values.double()
    order = sorted(range(len(values)), key=lambda i: -abs(float(values[i])))
    chosen = [token] if against is None else [token, against]
    return {"position": position, "token": _token(view, token),
            "against": None if against is None else _token(view, against),
            "order": order, "shown": ATTRIBUTION_SHOWN,
            "candidates": [_token(view, i) for i in dict.fromkeys([*chosen, *shown])],
            "labels": found.labels, "values": rounded(values),
            "sum": float(values.sum()), "logit": found.logit,
            "softcap": view.model.config.logit_softcap,
            "heads": rounded(found.heads), "mlps": rounded(found.mlps)}


# --- head scores -------------------------------------------------------------------------------

def score_half(block_size: int) -> int | None:
    """The random half's length for the view's head scores (None: a context under 4 tokens
    has no second half to score)."""
    half = min(SCORE_HALF, block_size // 2)
    return half if half >= 2 else None


SCORE_FLOPS = 1e11  # the most a model's head scores may cost, in multiply-adds x 2


def score_batch(model: Any, half: int) -> int:
    """Sequences of 2 * half tokens the head scores average over: 8, or as many (at least one)
    as fit SCORE_FLOPS at 2 FLOPs per parameter and token (a 0.6B model: one, about a second
    of the page's first screen rather than ten)."""
    flops_per_sequence = 2 * count_parameters(model) * 2 * half
    return max(1, min(8, int(SCORE_FLOPS // flops_per_sequence)))


@dataclass(frozen=True)
class ViewScores:
    """The head scores the page's badges show, and what they were measured on."""

    scores: HeadScores
    text: str  # "validation": windows of the run's validation text; "random": random tokens
    sequences: int  # how many repeated sequences the scores average over


def text_windows(text: np.ndarray | None, half: int, batch: int) -> Tensor | None:
    """Up to `batch` windows of `half` tokens spread evenly through `text` (the run's
    validation ids), each followed by itself: (batch, 2 * half). None when the text is shorter
    than one window."""
    if text is None or len(text) < half:
        return None
    starts = dict.fromkeys(np.linspace(0, len(text) - half, batch).astype(int).tolist())
    windows = torch.stack([torch.as_tensor(np.asarray(text[s:s + half], dtype=np.int64))
                           for s in starts])  # (batch, half)
    return torch.cat([windows, windows], dim=1)  # (batch, 2 * half)


def scores_of(model: Any, text: np.ndarray | None = None) -> ViewScores | None:
    """Every head's scores on the run's own kind of text: windows of its validation text
    `text`, each repeated once (a model trained on text copies what looks like its text: the
    docs' induction run, whose heads patching shows at 1.00, read 0.00-0.02 on random ids over
    the whole vocabulary), else on random tokens repeated. None: no room to repeat."""
    half = score_half(model.config.block_size)
    if half is None:
        return None
    batch = score_batch(model, half)
    tokens = text_windows(text, half, batch)
    if tokens is None:
        return ViewScores(head_scores(model, half=half, batch=batch), "random", batch)
    return ViewScores(head_scores(model, tokens=tokens), "validation", tokens.shape[0])


def scores_answer(found: ViewScores | None) -> dict[str, Any] | None:
    if found is None:
        return None
    return {"previous_token": rounded(found.scores.previous_token),
            "induction": rounded(found.scores.induction), "half": found.scores.half,
            "text": found.text, "sequences": found.sequences}


# --- inside the MLP ----------------------------------------------------------------------------

def mlp_table(view: View, layer: int) -> list[tuple[str, str, str]]:
    """(step, the hook point relative to the block, title) for the MLP of `layer`."""
    block = view.model.blocks[layer]
    gated = isinstance(block.ffn, SwiGLUFeedForward)
    activation = view.model.config.activation
    norm = type(block.ln2).__name__
    rows = [("resid_mid", "hook_resid_mid", "the residual stream after attention (u)")]
    if block.pre_ln:
        rows.append(("normed", "ln2.hook_normalized",
                     f"ln2 ({norm}): u normalised, before its gain: what the MLP reads, scaled"))
    if gated:  # SwiGLU's gate through SiLU, GeGLU's (Gemma) through tanh-GELU
        gate = "gelu_tanh" if activation == "geglu" else "silu"
        rows += [("pre", "ffn.hook_pre", f"gate(x): the gate projection, before its {gate}"),
                 ("pre_linear", "ffn.hook_pre_linear", "up(x): the up projection"),
                 ("post", "ffn.hook_post", f"{gate}(gate) * up: the gate lets each feature "
                  "through")]
    else:
        rows += [("pre", "ffn.hook_pre", f"fc(x): the up projection, before the {activation}"),
                 ("post", "ffn.hook_post", f"{activation}(pre): the activation")]
    rows.append(("mlp_out", "hook_mlp_out",
                 "proj(post): the down projection, what the MLP adds to the residual stream"
                 if block.ln2_post is None else "ln2_post(proj(post)): the down projection, "
                 "normalised (post_norms): what the MLP adds to the residual stream"))
    rows.append(("resid_post", "hook_resid_post", "u + mlp_out: the stream leaving the block"
                 if block.pre_ln else f"ln2(u + mlp_out) ({norm}, Post-LN): leaving the block"))
    return rows


def mlp(view: View, prompt: str, layer: int, position: int) -> dict[str, Any]:
    """The token at `position` through the MLP of `layer`, step by step: each step's values
    from `run_with_cache` and the line that computes it (the caller of its hook point)."""
    checks.index("layer", layer, view.model.config.n_layer)
    encoded = view.encode(prompt)
    checks.index("position", position, len(encoded.ids))
    if view.model.blocks[layer].ffn is None:
        return {"layer": layer, "position": position, "hidden": 0, "gated": False, "steps": [],
                "note": f"layer {layer} has no MLP: the model is attention-only"}
    table = mlp_table(view, layer)
    cache, sources = block_sources(view.model, encoded.idx, layer,
                                   {step: point for step, point, _ in table})
    at = f"blocks.{layer}."
    block = view.model.blocks[layer]
    return {"layer": layer, "position": position,
            "hidden": cache[at + "mlp.hook_post"].shape[-1],
            "gated": isinstance(block.ffn, SwiGLUFeedForward),
            "steps": [step_answer(step, title, cache[at + lens_name(point)][0, position],
                                  sources[step]) for step, point, title in table]}


# --- inside one head: q and k before QK-norm and the rotation -----------------------------------

def qk_stages(view: View, prompt: Prompt, layer: int, head: int, position: int,
              seen: slice) -> dict[str, list[tuple[str, str, Tensor]]]:
    """The stages q and k pass before the ones attention scores (`HeadSteps.q`, `.keys`):
    the projection (`hook_q`, `hook_k`) and, with QK-norm, normalised before its gain
    (`q_norm.hook_normalized`); none when q and k are the projection itself. From
    `run_with_cache`: {"q": [(step, title, values (d,))], "k": [... values (seen, d)]}."""
    attn = view.model.blocks[layer].attn
    if attn.q_norm is None and attn.rotary is None:
        return {"q": [], "k": []}
    kv_head = attn.kv_head_of(head)
    at = f"blocks.{layer}.attn"
    names = [f"{at}.hook_q", f"{at}.hook_k"]
    if attn.q_norm is not None:
        names += [f"{at}.q_norm.hook_normalized", f"{at}.k_norm.hook_normalized"]
    _, cache = run_with_cache(view.model, prompt.idx, names=names, stop_at_layer=layer + 1)
    stages: dict[str, list[tuple[str, str, Tensor]]] = {
        "q": [("q_proj", f"q = x W_Q: head {head}'s projection, before "
               f"{_turns(attn)}", cache[f"{at}.hook_q"][0, position, head])],
        "k": [("k_proj", f"k = x W_K: the keys' projection (K/V head {kv_head}), before "
               f"{_turns(attn)}", cache[f"{at}.hook_k"][0, seen, kv_head])]}
    if attn.q_norm is not None:  # its points show TransformerLens's (B, T, heads, d)
        then = ", then the rotation" if attn.rotary is not None else ""
        stages["q"].append(("q_normed", f"q / rms(q): QK-norm, before its gain{then}",
                            cache[f"{at}.q_norm.hook_normalized"][0, position, head]))
        stages["k"].append(("k_normed", f"k / rms(k): QK-norm, before its gain{then}",
                            cache[f"{at}.k_norm.hook_normalized"][0, seen, kv_head]))
    return stages


def _turns(attn: Any) -> str:
    parts = [name for name, module in (("QK-norm", attn.q_norm), ("the rotation", attn.rotary))
             if module is not None]
    return " and ".join(parts)
