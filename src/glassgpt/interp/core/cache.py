"""What a run left at its hook points: `ActivationCache`, name -> activation, indexed and
analysed as TransformerLens's cache is, and `cached`, a lookup that names what is missing.

    cache["blocks.0.attn.hook_pattern"] == cache["pattern", 0] == cache["pattern0"]
    cache["k", -1]                       # the last block's keys
    stack, labels = cache.decompose_resid(return_labels=True)   # "embed", "0_attn_out", ...

The analysis (the residual stream split into what each part wrote, TransformerLens's
`decompose_resid`, `stack_head_results`, `logit_attrs`, ...) lives in `glassgpt.interp.core.resid`;
the methods here are its TransformerLens-shaped entry points. Shapes: L = layers, B = batch,
T = positions, C = width, H = heads, F = MLP width; "..." is (B, T), or less after
`remove_batch_dim` or an int position.
"""

from __future__ import annotations

import difflib
import weakref
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from glassgpt.errors import InputError
from glassgpt.hooknames import parse_hook_name
from glassgpt.interp.core import resid
from glassgpt.interp.core.resid import Slicing
from glassgpt.interp.core.utils import get_act_name


class MissingActivationError(InputError, KeyError):
    """A cache holds no activation under the name asked for (a KeyError too, as a Mapping's
    missing key is). The message names the missing point and the closest names held."""

    def __str__(self) -> str:  # KeyError's would quote the whole message
        return str(self.args[0])


class ActivationCache(Mapping[str, Tensor]):
    """Hook name -> the activation a run produced there (detached). A key not held verbatim is
    read as TransformerLens reads it (a short name, "k6", or (name, layer, layer_type) with a
    negative layer counting from the end); a missing one raises MissingActivationError, naming
    the full name and the closest held. `ids` and `model` are the run's own (the model weakly
    held), so a reader can tell a cache of other tokens or another model from the one it was
    handed; the analysis methods read the model's weights (W_O, W_out, W_U)."""

    def __init__(self, tensors: dict[str, Tensor], ids: Tensor | None = None,
                 model: nn.Module | None = None, has_batch_dim: bool = True):
        if isinstance(ids, nn.Module):  # TransformerLens's order (ARENA's code builds caches
            # as ActivationCache(tensors, model[, has_batch_dim]))
            has_batch_dim = model if isinstance(model, bool) else has_batch_dim
            ids, model = None, ids
        self._tensors = tensors
        self.ids = ids
        self._model = None if model is None else weakref.ref(model)
        self.has_batch_dim = has_batch_dim

    @property
    def model(self) -> nn.Module | None:
        return None if self._model is None else self._model()

    # -- indexing ---------------------------------------------------------------------------

    def full_name(self, key: object) -> str:
        """The hook name `key` stands for: itself when held, else TransformerLens's reading of
        it (get_act_name; a negative layer counts from the end). MissingActivationError for a
        key that names no activation at all."""
        if isinstance(key, str):
            if key in self._tensors:
                return key
            return self._act_name(key)
        if isinstance(key, tuple) and 1 <= len(key) <= 3:
            name, layer, layer_type = (*key, None, None)[:3]
            if isinstance(layer, int) and not isinstance(layer, bool) and layer < 0:
                n_layer = self._n_layer()
                if layer < -n_layer:  # named as given, not as the index it would become
                    raise MissingActivationError(f"layer {layer} does not exist: this cache's "
                                                 f"model has layers 0..{n_layer - 1} (or -1 .. "
                                                 f"-{n_layer} from the end)")
                layer += n_layer
            return self._act_name(name, layer, layer_type)
        raise MissingActivationError(f"a cache key is a hook name or (name, layer[, layer_type]), "
                                     f"got {key!r:.60}")

    def _act_name(self, *parts: Any) -> str:
        try:
            return get_act_name(*parts)
        except InputError as error:  # a KeyError too, so `in` and .get() read it as missing
            raise MissingActivationError(str(error)) from None

    def _n_layer(self) -> int:
        model = self.model
        if model is not None:
            return model.config.n_layer
        return len({parse_hook_name(name).layer for name in self._tensors} - {None})

    def __getitem__(self, key: object) -> Tensor:
        name = self.full_name(key)
        if name not in self._tensors:
            raise MissingActivationError(unknown_name_message(name, self._tensors, "this cache"))
        return self._tensors[name]

    def __contains__(self, key: object) -> bool:
        try:
            return self.full_name(key) in self._tensors
        except MissingActivationError:
            return False

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    def __repr__(self) -> str:
        return f"ActivationCache({len(self)} activations)"

    # -- the batch axis and the device -----------------------------------------------------

    def batch_size(self) -> int:
        """The run's batch: its ids' rows, else the most common leading size held."""
        if not self.has_batch_dim:
            raise InputError("this cache's batch axis was removed (remove_batch_dim)")
        if self.ids is not None:
            return self.ids.shape[0]
        sizes = Counter(t.shape[0] for t in self._tensors.values() if t.dim() > 0)
        return sizes.most_common(1)[0][0] if sizes else 1

    def remove_batch_dim(self) -> ActivationCache:
        """Drop the batch axis of every activation, in place, when the batch is one prompt
        (TransformerLens's layout then: (T, C), (H, T, T), ...); a second call does nothing."""
        if not self.has_batch_dim:
            return self
        if self.batch_size() != 1:
            raise InputError(f"remove_batch_dim takes a cache of one prompt; this one has a "
                             f"batch of {self.batch_size()}: index it first "
                             "(apply_slice_to_batch_dim)")
        self._tensors = {name: t[0] for name, t in self._tensors.items()}
        self.has_batch_dim = False
        return self

    def apply_slice_to_batch_dim(self, batch_slice: Any) -> ActivationCache:
        """A new cache of the prompts `batch_slice` picks (an int drops the batch axis)."""
        if not self.has_batch_dim:
            raise InputError("this cache has no batch axis to slice (remove_batch_dim)")
        index = resid.as_index(batch_slice, "batch_slice")
        tensors = {name: resid.take(t, index, 0) for name, t in self._tensors.items()}
        ids = None if self.ids is None else resid.take(self.ids, index, 0)
        return ActivationCache(tensors, ids, self.model, has_batch_dim=not isinstance(index, int))

    def to(self, device: str | torch.device) -> ActivationCache:
        """Every activation (and the ids) moved to `device`, in place; the cache comes back."""
        self._tensors = {name: t.to(device) for name, t in self._tensors.items()}
        self.ids = None if self.ids is None else self.ids.to(device)
        return self

    # -- analysis: TransformerLens's signatures, glassgpt.interp.core.resid's work ---------------

    def accumulated_resid(self, layer: int | None = None, incl_mid: bool = False,
                          apply_ln: bool = False, pos_slice: Slicing = None,
                          mlp_input: bool = False, return_labels: bool = False):
        """The residual stream before each block up to `layer` (None: after the last, "final_post"),
        stacked (L', ..., C); labels "0_pre", "0_mid", ..., "final_post"."""
        return resid.accumulated_resid(self, layer, incl_mid, apply_ln, pos_slice, mlp_input,
                                       return_labels)

    def decompose_resid(self, layer: int | None = None, mlp_input: bool = False,
                        mode: str = "all", apply_ln: bool = False, pos_slice: Slicing = None,
                        incl_embeds: bool = True, return_labels: bool = False):
        """The stream into `layer` as what wrote it: "embed", "pos_embed" (when positions join
        the stream), "{l}_attn_out", "{l}_mlp_out"; they add up to the stream."""
        return resid.decompose_resid(self, layer, mlp_input, mode, apply_ln, pos_slice,
                                     incl_embeds, return_labels)

    def compute_head_results(self) -> None:
        """Each head's output z_h @ W_O[h] (B, T, H, C) under blocks.{l}.attn.hook_result,
        computed from hook_z where the run did not keep it."""
        resid.compute_head_results(self)

    def stack_head_results(self, layer: int = -1, return_labels: bool = False,
                           incl_remainder: bool = False, pos_slice: Slicing = None,
                           apply_ln: bool = False):
        """Every head's output before `layer`, stacked (L * H, ..., C), labels "L0H0", ...;
        with `incl_remainder` the rest of the stream as a last "remainder"."""
        return resid.stack_head_results(self, layer, return_labels, incl_remainder, pos_slice,
                                        apply_ln)

    def stack_activation(self, activation_name: str, layer: int = -1,
                         sublayer_type: str | None = None) -> Tensor:
        """cache[activation_name, l, sublayer_type] for each block before `layer`, stacked."""
        return resid.stack_activation(self, activation_name, layer, sublayer_type)

    def get_neuron_results(self, layer: int, neuron_slice: Slicing = None,
                           pos_slice: Slicing = None,
                           project_output_onto: Tensor | None = None) -> Tensor:
        """What each neuron of block `layer`'s MLP writes: post[n] * W_out[n], (..., F, C)."""
        return resid.get_neuron_results(self, layer, neuron_slice, pos_slice,
                                        project_output_onto)

    def stack_neuron_results(self, layer: int, pos_slice: Slicing = None,
                             neuron_slice: Slicing = None, return_labels: bool = False,
                             incl_remainder: bool = False, apply_ln: bool = False,
                             project_output_onto: Tensor | None = None,
                             mlp_input: bool = False):
        """Every neuron's output before `layer`, stacked (L * F, ..., C), labels "L0N0", ..."""
        return resid.stack_neuron_results(self, layer, pos_slice, neuron_slice, return_labels,
                                          incl_remainder, apply_ln, project_output_onto,
                                          mlp_input)

    def apply_ln_to_stack(self, residual_stack: Tensor, layer: int | None = None,
                          mlp_input: bool = False, pos_slice: Slicing = None,
                          batch_slice: Slicing = None, has_batch_dim: bool = True,
                          recompute_ln: bool = False) -> Tensor:
        """Parts of the stream as the norm before `layer` sees them: centred (LayerNorm) and
        divided by the run's own scale there, no gain (TransformerLens assumes it folded)."""
        return resid.apply_ln_to_stack(self, residual_stack, layer, mlp_input, pos_slice,
                                       batch_slice, has_batch_dim, recompute_ln)

    def logit_attrs(self, residual_stack: Tensor, tokens: Any, incorrect_tokens: Any = None,
                    pos_slice: Slicing = None, batch_slice: Slicing = None,
                    has_batch_dim: bool = True) -> Tensor:
        """Each part's push on the logit of `tokens` (less `incorrect_tokens`'): the part through
        the final norm's scale, dotted with the tokens' unembedding directions."""
        return resid.logit_attrs(self, residual_stack, tokens, incorrect_tokens, pos_slice,
                                 batch_slice, has_batch_dim)

    def get_full_resid_decomposition(self, layer: int | None = None, mlp_input: bool = False,
                                     expand_neurons: bool = True, apply_ln: bool = False,
                                     pos_slice: Slicing = None, return_labels: bool = False,
                                     project_output_onto: Tensor | None = None):
        """The stream into `layer` as every head, every neuron (or MLP), "embed", "pos_embed"
        and the summed output biases ("bias"); they add up to the stream."""
        return resid.get_full_resid_decomposition(self, layer, mlp_input, expand_neurons,
                                                  apply_ln, pos_slice, return_labels,
                                                  project_output_onto)


def cached(cache: Mapping[str, Tensor], name: str) -> Tensor:
    """cache[name] from an ActivationCache or a plain dict of tensors; a missing name raises
    MissingActivationError naming it (a dict's bare KeyError would name nothing)."""
    if name not in cache:
        raise MissingActivationError(unknown_name_message(name, cache, "the cache"))
    return cache[name]


def unknown_name_message(name: object, known: Iterable[str], where: str) -> str:
    known = list(known)
    close = difflib.get_close_matches(str(name), known, n=3)
    hint = f"; did you mean {', '.join(close)}?" if close else f"; it has {len(known)} names"
    return f"no hook point {name!r} in {where}{hint}"
