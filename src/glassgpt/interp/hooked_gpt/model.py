"""HookedGPT: a glassgpt GPT with TransformerLens's face, so TransformerLens and ARENA code runs
on it unchanged.

    model = HookedGPT.from_run("runs/x")               # or HookedGPT(gpt, tokenizer)
    logits, cache = model.run_with_cache("Hello world", remove_batch_dim=True)
    cache["pattern", 0]                                # (H, T, T)
    model.run_with_hooks(tokens, return_type=None,
                         fwd_hooks=[(lambda name: name.endswith("pattern"), score_hook)])
    model.W_Q.shape                                    # (L, H, C, d); model.OV a FactoredMatrix

It wraps the glass model (`model.glass`, a submodule: `.to()`, `.eval()`, `parameters()` work)
and changes nothing in it. Every run goes through glassgpt.interp's `run_with_hooks`: its
checks, its guard against a run started from a hook, eval mode, and hooks removed afterwards.
A TransformerLens hook is called `fn(tensor, hook=point)`, `point` being glassgpt's HookPoint
(`point.name`, `point.layer()`, `point.ctx`, a dict that stays on the point between runs), and
may edit the tensor in place and return None. Hooks added with `add_hook` or `hooks()` stay
attached to every run until `reset_hooks`. A backward hook (`bwd_hooks`, dir="bwd") is called
`fn(grad, hook=point)` when the caller backpropagates through a run's output (it hangs on the
run's autograd graph, so it fires after the run returned); `run_with_cache(incl_bwd=True)`
calls backward on the output itself (return_type="loss") and caches `{name}_grad`.

The weights in TransformerLens's layout are `LensWeights`'s, the tokenisation methods
`LensTokenMethods`'s (what BOS is: glassgpt.interp.hooked_gpt.tokens), the settings `LensConfig`'s;
`fold_ln`, `center_writing_weights` and `center_unembed` process a copy of the weights
(glassgpt.interp.hooked_gpt.process). glassgpt.interp's free functions take a HookedGPT too: the
glass model's own attributes (`config`, `blocks`, `ln_f`, `lm_head`, ...) read through.
Notation: B = batch, T = positions, C = width, V = vocabulary.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from glassgpt.errors import InputError, ModelError
from glassgpt.formats.transformer_lens import lens_state_dict
from glassgpt.formats.transformer_lens_config import FOLDED_TYPES, LensConfig, lens_config
from glassgpt.formats.transformer_lens_files import load_lens_checkpoint
from glassgpt.inputs import check_token_ids
from glassgpt.interp.core.cache import ActivationCache
from glassgpt.interp.core.hooked import hook_points, run_with_hooks, select_names
from glassgpt.interp.hooked_gpt import process
from glassgpt.interp.hooked_gpt.hooks import AttachedHook, LensHookFn, LensHookMethods
from glassgpt.interp.hooked_gpt.tokens import LensTokenizer, LensTokenMethods
from glassgpt.interp.hooked_gpt.weights import LensWeights
from glassgpt.model import GPT
from glassgpt.rundir.checkpoint import load_model
from glassgpt.tokenizers import Tokenizer

RETURN_TYPES = ("logits", "loss", "both", None)
# What a glassgpt Tokenizer (a Protocol, so not an isinstance check) offers and LensTokenizer reads.
TOKENIZER_METHODS = ("kind", "vocab_size", "encode", "decode", "leading_special_ids")


def loss_fn(logits: Tensor, tokens: Tensor, attention_mask: Tensor | None = None,
            per_token: bool = False) -> Tensor:
    """TransformerLens's next-token loss: -log p(tokens[:, i + 1]) at each position i, (B, T - 1)
    with `per_token`, else its mean (over the positions whose token and next token are real,
    where `attention_mask` (B, T) marks padding with 0)."""
    if not isinstance(logits, Tensor) or logits.dim() != 3 or not isinstance(tokens, Tensor) \
            or tuple(tokens.shape) != tuple(logits.shape[:2]) or tokens.shape[1] < 2:
        got = [tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
               for x in (logits, tokens)]
        raise InputError(f"loss_fn takes logits (B, T, V) and tokens (B, T), T >= 2, got "
                         f"{got[0]} and {got[1]}")
    check_token_ids(tokens, logits.shape[-1])  # integers in the logits' vocabulary
    if attention_mask is not None and (not isinstance(attention_mask, Tensor)
                                       or attention_mask.shape != tokens.shape):
        got = (tuple(attention_mask.shape) if isinstance(attention_mask, Tensor)
               else type(attention_mask).__name__)
        raise InputError(f"attention_mask must be a tensor shaped as tokens "
                         f"{tuple(tokens.shape)}, got {got}")
    log_probs = F.log_softmax(logits, dim=-1)[:, :-1]  # (B, T - 1, V)
    next_tokens = tokens[:, 1:].to(logits.device)  # (B, T - 1)
    losses = -log_probs.gather(-1, next_tokens[..., None])[..., 0]  # (B, T - 1)
    if attention_mask is None:
        return losses if per_token else losses.mean()
    real = attention_mask.to(logits.device).bool()
    both_real = real[:, :-1] & real[:, 1:]  # (B, T - 1)
    losses = losses.masked_fill(~both_real, 0.0)
    return losses if per_token else losses.sum() / both_real.sum().clamp(min=1)


def lens_tokenizer(tokenizer: Tokenizer | LensTokenizer | None,
                   bos: str | None) -> LensTokenizer | None:
    """A HookedGPT's tokenizer: `tokenizer` with Hugging Face's face, `bos` playing BOS."""
    if tokenizer is None:
        if bos is not None:
            raise InputError(f"bos={bos!r:.40} needs a tokenizer to be a token of: give one")
        return None
    if isinstance(tokenizer, LensTokenizer):
        return tokenizer if bos is None else LensTokenizer(tokenizer.inner, bos)
    missing = [name for name in TOKENIZER_METHODS if not hasattr(tokenizer, name)]
    if missing:  # a Hugging Face tokenizer, a name: never the tokenizer the model was made with
        raise InputError(f"tokenizer must be a glassgpt tokenizer (a run's: "
                         f"glassgpt.rundir.checkpoint.read_tokenizer(run_dir)), got "
                         f"{type(tokenizer).__name__}, which has no {', '.join(missing)}")
    return LensTokenizer(tokenizer, bos)


class HookedGPT(LensHookMethods, LensWeights, LensTokenMethods, nn.Module):
    """A glassgpt GPT (`glass`) as TransformerLens's HookedTransformer: `model(input,
    return_type=...)`, `run_with_cache`, `run_with_hooks`, `hooks`, `add_hook`, `reset_hooks`,
    `cfg`, `tokenizer`, the weights in TransformerLens's layout and its tokenisation methods."""

    def __init__(self, model: GPT, tokenizer: Tokenizer | LensTokenizer | None = None, *,
                 fold_ln: bool = False, center_writing_weights: bool = False,
                 center_unembed: bool = False, model_name: str = "glassgpt",
                 bos: str | None = None):
        """`bos`: a text that is one token of `tokenizer`, to play the begin-of-sequence token
        where the tokenizer has none (a character run: `bos="\\n"`); see hooked_gpt.tokens."""
        super().__init__()
        if not isinstance(model, GPT):
            raise ModelError(f"HookedGPT wraps a glassgpt GPT, got {type(model).__name__}")
        self.glass = model
        self.tokenizer = lens_tokenizer(tokenizer, bos)
        if self.tokenizer is not None and len(self.tokenizer) > model.config.vocab_size:
            raise ModelError(f"the tokenizer has {len(self.tokenizer)} tokens, more than the "
                             f"model's vocab_size={model.config.vocab_size}")
        has_bos = self.tokenizer is not None and self.tokenizer.bos_token_id is not None
        kind = None if self.tokenizer is None else f"glassgpt {self.tokenizer.inner.kind}"
        self.cfg: LensConfig = lens_config(model, has_bos, model_name, kind)
        self._points = hook_points(model)
        self._attached: list[AttachedHook] = []
        self._context_level = 0
        self._owns_weights = False  # True once the weights are a copy of the caller's model's
        for wanted, step in ((fold_ln, self.fold_layer_norm),
                             (center_writing_weights, self.center_writing_weights),
                             (center_unembed, self.center_unembed)):
            if wanted:
                step()

    @classmethod
    def from_run(cls, run_dir: str | Path, *, checkpoint: str = "best",
                 device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
                 fold_ln: bool = False, center_writing_weights: bool = False,
                 center_unembed: bool = False, bos: str | None = None) -> HookedGPT:
        """The model and tokenizer of a run directory (trained here or imported from Hugging
        Face), as `glassgpt sample` and the view open it; `bos="\\n"` (one token of the run's
        tokenizer) plays BOS where the tokenizer has none, as a character run's."""
        model, tokenizer = load_model(run_dir, device, checkpoint, dtype)
        return cls(model, tokenizer, fold_ln=fold_ln,
                   center_writing_weights=center_writing_weights,
                   center_unembed=center_unembed, model_name=Path(run_dir).name, bos=bos)

    @classmethod
    def from_lens_checkpoint(cls, cfg: dict[str, Any] | str | Path,
                             state_dict: dict[str, Tensor] | str | Path,
                             tokenizer: Tokenizer | LensTokenizer | None = None) -> HookedGPT:
        """A TransformerLens checkpoint (ARENA's pretrained models): HookedTransformerConfig's
        fields (a dict or config.json), HookedTransformer.state_dict() (a dict, .safetensors or
        .pth of tensors) as a glass model computing the same (glassgpt.formats.transformer_lens)."""
        model = load_lens_checkpoint(cfg, state_dict)
        name = cfg.get("model_name") if isinstance(cfg, dict) else None
        return cls(model, tokenizer, model_name=name if isinstance(name, str) else "lens")

    def lens_state_dict(self) -> dict[str, Tensor]:
        """The weights as HookedTransformer.state_dict() holds them
        (glassgpt.formats.transformer_lens)."""
        return lens_state_dict(self.glass)

    # --- the glass model's own attributes, for glassgpt.interp's free functions ---------------

    @property
    def config(self) -> Any:
        return self.glass.config

    @property
    def blocks(self) -> nn.ModuleList:
        return self.glass.blocks

    @property
    def tok_emb(self) -> nn.Embedding:
        return self.glass.tok_emb

    @property
    def pos_emb(self) -> nn.Embedding | None:
        return self.glass.pos_emb

    @property
    def ln_f(self) -> nn.Module:
        return self.glass.ln_f

    @property
    def lm_head(self) -> nn.Linear:
        return self.glass.lm_head

    def layers(self, idx: Tensor, **options: Any) -> Iterator[tuple[int, Tensor]]:
        return self.glass.layers(idx, **options)

    def check_tokens(self, idx: Tensor, start_pos: int = 0, check_ids: bool = True) -> None:
        self.glass.check_tokens(idx, start_pos, check_ids)

    def read_out(self, x: Tensor) -> Tensor:
        return self.glass.read_out(x)

    # --- running ----------------------------------------------------------------------------

    def forward(self, input: str | list[str] | Tensor, return_type: str | None = "logits",
                loss_per_token: bool = False, prepend_bos: bool | None = None,
                stop_at_layer: int | None = None,
                padding_side: str | None = None) -> Tensor | tuple[Tensor, Tensor] | None:
        """A text, texts or token ids (B, T) / (T,) -> logits (B, T, V) ("logits"), the
        next-token loss ("loss", (B, T - 1) with loss_per_token), both, or None; with
        `stop_at_layer` l (negative: from the end) the residual stream (B, T, C) after the first
        l blocks, whatever the return_type."""
        return self._run(input, return_type, loss_per_token, prepend_bos, stop_at_layer,
                         padding_side)

    def run_with_hooks(self, input: str | list[str] | Tensor,
                       fwd_hooks: Iterable[tuple[Any, LensHookFn]] = (),
                       bwd_hooks: Iterable[tuple[Any, LensHookFn]] = (),
                       reset_hooks_end: bool = True, clear_contexts: bool = False,
                       **forward_options: Any) -> Any:
        """`model(input, **forward_options)` with `fwd_hooks` attached for this run (and kept
        with reset_hooks_end=False); `bwd_hooks` fire when the caller backpropagates through
        the output (e.g. `model.run_with_hooks(ids, return_type="loss", bwd_hooks=...)
        .backward()`)."""
        with self.hooks(fwd_hooks, bwd_hooks, reset_hooks_end, clear_contexts):
            return self(input, **forward_options)

    def run_with_cache(self, input: str | list[str] | Tensor, names_filter: Any = None,
                       remove_batch_dim: bool = False, return_type: str | None = "logits",
                       loss_per_token: bool = False, prepend_bos: bool | None = None,
                       stop_at_layer: int | None = None,
                       padding_side: str | None = None,
                       incl_bwd: bool = False) -> tuple[Any, ActivationCache]:
        """(`model(input, ...)`'s output, the activations `names_filter` picks (None: all; a
        name, names, or a predicate on names), detached); `remove_batch_dim` drops the batch
        axis of a one-prompt run. The attached hooks run first: the cache holds what they left.
        With `incl_bwd=True` (as TransformerLens: the output must be a scalar, e.g.
        return_type="loss") `output.backward()` runs too, and the cache holds each point's
        gradient under `{name}_grad`."""
        store: dict[str, Tensor] = {}

        def keep(tensor: Tensor, name: str) -> None:
            store[name] = tensor.detach()

        def keep_grad(grad: Tensor, name: str) -> None:
            store[f"{name}_grad"] = grad.detach()

        selected = select_names(self._points, names_filter)
        ids, mask = self._input_ids(input, prepend_bos, padding_side)
        if remove_batch_dim and ids.shape[0] != 1:
            raise InputError(f"remove_batch_dim takes one prompt, got a batch of {ids.shape[0]}")
        if incl_bwd and (stop_at_layer is not None or return_type not in ("loss", "both")
                         or loss_per_token):
            raise InputError("incl_bwd=True calls backward on the output, which must be a scalar:"
                             " run with return_type='loss' (no loss_per_token, no stop_at_layer)")
        with torch.enable_grad() if incl_bwd else contextlib.nullcontext():
            output = self._run_ids(ids, mask, return_type, loss_per_token, stop_at_layer,
                                   [(name, keep) for name in selected],
                                   [(name, keep_grad) for name in selected] if incl_bwd else [])
            if incl_bwd:
                (output if return_type == "loss" else output[1]).backward()
        ordered = {name: store[name] for name in self._points if name in store}
        if incl_bwd:  # gradients in forward order too; zeros where the loss does not reach
            ordered |= {f"{name}_grad": store.get(f"{name}_grad", torch.zeros_like(value))
                        for name, value in list(ordered.items())}
        cache = ActivationCache(ordered, ids=ids, model=self)
        return output, cache.remove_batch_dim() if remove_batch_dim else cache

    def loss_fn(self, logits: Tensor, tokens: Tensor, attention_mask: Tensor | None = None,
                per_token: bool = False) -> Tensor:
        return loss_fn(logits, tokens, attention_mask, per_token)

    def _run(self, input: Any, return_type: str | None, loss_per_token: bool,
             prepend_bos: bool | None, stop_at_layer: int | None,
             padding_side: str | None) -> Any:
        ids, mask = self._input_ids(input, prepend_bos, padding_side)
        return self._run_ids(ids, mask, return_type, loss_per_token, stop_at_layer, [])

    def _run_ids(self, ids: Tensor, mask: Tensor | None, return_type: str | None,
                 loss_per_token: bool, stop_at_layer: int | None,
                 extra: list[tuple[str, Callable]],
                 extra_bwd: list[tuple[str, Callable]] = ()) -> Any:
        """One run of the glass model with the attached hooks, then `extra` ones (and the
        attached backward hooks, then `extra_bwd`)."""
        if return_type not in RETURN_TYPES:
            raise InputError(f"return_type must be 'logits', 'loss', 'both' or None, got "
                             f"{return_type!r:.40}")
        if isinstance(stop_at_layer, int) and not isinstance(stop_at_layer, bool) \
                and stop_at_layer < 0:
            n_layers = self.cfg.n_layers
            if stop_at_layer < -n_layers:  # named as given, not as the count it would become
                raise InputError(f"stop_at_layer must be an int in [-{n_layers}, {n_layers}], "
                                 f"got {stop_at_layer}")
            stop_at_layer += n_layers  # TransformerLens's: -1 skips the last block
        hooks = [*((hook.name, hook.fn) for hook in self._attached if hook.dir == "fwd"), *extra]
        bwd = [*((hook.name, hook.fn) for hook in self._attached if hook.dir == "bwd"),
               *extra_bwd]
        if not torch.is_grad_enabled():  # no graph for a backward hook to hang on (TL's too)
            bwd = []
        output = run_with_hooks(self.glass, ids, hooks, stop_at_layer, bwd_hooks=bwd)
        if stop_at_layer is not None or return_type == "logits":
            return output  # (B, T, C) or (B, T, V)
        if return_type is None:
            return None
        loss = loss_fn(output, ids, mask, loss_per_token)
        return loss if return_type == "loss" else (output, loss)

    def _input_ids(self, input: Any, prepend_bos: bool | None,
                   padding_side: str | None) -> tuple[Tensor, Tensor | None]:
        """A text, texts or ids -> (ids (B, T) on the model's device, padding mask or None)."""
        device = self.glass.tok_emb.weight.device
        if isinstance(input, Tensor):
            ids = input[None] if input.dim() == 1 else input  # (T,) -> (1, T)
            return ids.to(device), None
        if isinstance(input, str) or (isinstance(input, list) and input
                                      and all(isinstance(text, str) for text in input)):
            ids, mask = self.tokens_and_mask(input, prepend_bos, padding_side)
            if bool(mask.all()):
                return ids.to(device), None
            if not bool(mask[:, 0].all()):  # left padding would shift every position
                raise InputError("a run pads texts of different lengths on the right (the "
                                 "glass model takes no attention mask, and positions must start "
                                 "at each text's first token): leave padding_side as 'right'")
            return ids.to(device), mask.to(device)
        raise InputError(f"input must be a string, a list of strings or token ids (B, T) / "
                         f"(T,), got {input!r:.60}")

    # --- processing the weights (on a copy) -------------------------------------------------

    def _own_weights(self) -> nn.Module:
        """The glass model, copied the first time the weights are processed: the caller's
        model is never changed."""
        if not self._owns_weights:
            self.glass = copy.deepcopy(self.glass)
            self._points = hook_points(self.glass)
            self._owns_weights = True
        return self.glass

    def fold_layer_norm(self) -> None:
        """Fold each norm's gain and shift into the weights reading it (TransformerLens's
        fold_ln); cfg.normalization_type becomes "LNPre" / "RMSPre"."""
        process.fold_layer_norm(self._own_weights())
        self.cfg.normalization_type = FOLDED_TYPES[self.cfg.normalization_type]

    def center_writing_weights(self) -> None:
        """Centre W_E, W_pos, W_O, b_O, W_out, b_out over the width (LayerNorm models)."""
        process.center_writing_weights(self._own_weights())

    def center_unembed(self) -> None:
        """Centre W_U and b_U over the vocabulary (the log-probs stay as they were)."""
        process.center_unembed(self._own_weights())

    def set_use_attn_result(self, use_attn_result: bool) -> None:
        """TransformerLens's switch for `hook_result`; every glassgpt attention has the point
        (computed when watched), so this only records the setting in cfg."""
        self.cfg.use_attn_result = bool(use_attn_result)

    def _apply(self, fn: Callable, *args: Any, **kwargs: Any) -> HookedGPT:
        """`.to()`, `.cuda()`, `.half()`: cfg.device and cfg.dtype follow the weights."""
        super()._apply(fn, *args, **kwargs)
        weight = self.glass.tok_emb.weight
        self.cfg.device, self.cfg.dtype = str(weight.device), weight.dtype
        return self
