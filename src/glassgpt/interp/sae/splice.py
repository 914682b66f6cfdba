"""Dictionaries spliced into a run: `run_with_saes` and `run_with_cache_and_saes`.

Each SAE is attached to its hook point with glassgpt.interp's run_with_hooks (nothing is
threaded through the model): at `cfg.hook_name` its reconstruction replaces the activation, and
a transcoder reads `cfg.hook_name` and writes at `cfg.hook_name_out`. With `use_error_term` the
error x - x_hat of the untouched dictionary is added back, so the model's output is unchanged
until a hook edits a latent (SAELens's `use_error_term`; the error carries no gradient there).

The dictionary's own activations have SAELens's names, under the point it writes to:
    {point}.hook_sae_input        what the dictionary reads (a transcoder: its input point's)
    {point}.hook_sae_acts_pre     the pre-activations (..., d_sae)
    {point}.hook_sae_acts_post    the latents (..., d_sae)
    {point}.hook_sae_recons       the reconstruction (..., d_out)
    {point}.hook_sae_error        the error term (only with use_error_term, as in SAELens)
    {point}.hook_sae_output       what the model carries on with
A hook `fn(tensor, name)` on one of these reads or replaces it, as on any point of the model.
In a cache the model's own `{point}` holds what the model computed there, before the splice.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from glassgpt.errors import InputError
from glassgpt.hooks import check_replacement
from glassgpt.interp.core.cache import ActivationCache, unknown_name_message
from glassgpt.interp.core.hooked import (
    HookFn,
    NamesFilter,
    as_glass,
    check_hook_fn,
    check_run_ids,
    hook_points,
    run_with_cache,
    run_with_hooks,
    select_names,
)
from glassgpt.interp.core.names import stop_at_layer
from glassgpt.interp.sae.model import SAE

SAE_POINTS = ("hook_sae_input", "hook_sae_acts_pre", "hook_sae_acts_post", "hook_sae_recons",
              "hook_sae_error", "hook_sae_output")


def sae_hook_names(saes: SAE | Iterable[SAE], use_error_term: bool = False) -> list[str]:
    """The names of the spliced dictionaries' activations (`{point}.hook_sae_acts_post`, ...),
    in the order a run reaches them within each dictionary."""
    points = [p for p in SAE_POINTS if use_error_term or p != "hook_sae_error"]
    return [f"{sae.cfg.hook_name_out}.{point}" for sae in _as_list(saes) for point in points]


def run_with_saes(model: nn.Module, ids: Tensor, saes: SAE | Iterable[SAE], *,
                  use_error_term: bool = False,
                  hooks: Iterable[tuple[str | Callable[[str], bool], HookFn]] = ()) -> Tensor:
    """ids (B, T) -> logits (B, T, V) with each dictionary spliced into its hook point (see the
    module docstring). `hooks` are `(name, fn)` pairs on the model's points or the dictionaries'
    (`blocks.1.hook_resid_post.hook_sae_acts_post`), as run_with_hooks takes them. A dictionary
    for another width, a point the model lacks, or a transcoder whose output point comes first
    is refused by name before the run."""
    points = hook_points(model)
    check_run_ids(ids)
    saes = check_saes(model, ids, saes, points)
    sae_names = sae_hook_names(saes, use_error_term)
    model_hooks, sae_hooks = split_hooks(hooks, points, sae_names, use_error_term)
    splices, captures = [], []
    for sae in saes:
        splice, capture = splice_hooks(sae, use_error_term, sae_hooks)
        splices.append((sae.cfg.hook_name_out, splice))
        if capture is not None:
            captures.append((sae.cfg.hook_name, capture))
    # On one point: the caller's hooks first (they edit what the model computed), then the
    # splice, then a transcoder's capture (it reads what the model carries on with).
    return run_with_hooks(model, ids, [*model_hooks, *splices, *captures])


def run_with_cache_and_saes(model: nn.Module, ids: Tensor, saes: SAE | Iterable[SAE], *,
                            use_error_term: bool = False, names: NamesFilter = None
                            ) -> tuple[Tensor, ActivationCache]:
    """ids (B, T) -> (logits (B, T, V), cache) of a run with the dictionaries spliced in: the
    model's activations and the dictionaries' under SAELens's names, each right after the point
    it belongs to; `names` (None: all; a name, a list or a predicate) selects among both."""
    points = hook_points(model)
    saes = _as_list(saes)
    available = dict.fromkeys([*points, *sae_hook_names(saes, use_error_term)])
    selected = select_names(available, names)
    store: dict[str, Tensor] = {}

    def keep(tensor: Tensor, name: str) -> None:
        store[name] = tensor.detach()

    with torch.no_grad():
        logits = run_with_saes(model, ids, saes, use_error_term=use_error_term,
                               hooks=[(name, keep) for name in selected])
    ordered = {}
    for name in points:
        for held in (name, *(f"{name}.{point}" for point in SAE_POINTS)):
            if held in store:
                ordered[held] = store[held]
    return logits, ActivationCache(ordered, ids=ids, model=model)


# --- the splice ------------------------------------------------------------------------------

def splice_hooks(sae: SAE, use_error_term: bool, sae_hooks: Mapping[str, list[HookFn]]
                 ) -> tuple[HookFn, HookFn | None]:
    """(the hook at the dictionary's output point, the capture at a transcoder's input point
    or None). A transcoder's input is held from its point until its output point fires."""
    prefix, captured = sae.cfg.hook_name_out, []
    visit = _visitor(prefix, sae_hooks)

    def capture(activation: Tensor, name: str) -> None:
        captured.append(activation)

    def splice(activation: Tensor, name: str) -> Tensor:
        x_in = captured.pop() if sae.cfg.is_transcoder else activation
        target = activation
        if sae.cfg.reshape_activations == "hook_z":  # (B, T, H, d) -> (B, T, H * d)
            x_in, target = x_in.flatten(-2), target.flatten(-2)
        out = spliced(sae, x_in, target, use_error_term, visit)
        return out.reshape(activation.shape).to(activation.dtype)

    return splice, capture if sae.cfg.is_transcoder else None


def spliced(sae: SAE, x_in: Tensor, target: Tensor, use_error_term: bool,
            visit: Callable[[str, Tensor], Tensor]) -> Tensor:
    """What the model carries on with at the dictionary's output point: the reconstruction of
    x_in (..., d_in), plus, with the error term, target - the untouched reconstruction."""
    x_hat = sae.decode_visiting(sae.encode_visiting(x_in, visit), visit)  # (..., d_out)
    if use_error_term:
        with torch.no_grad():  # SAELens's: the error of the dictionary no hook has edited
            error = target - sae(x_in)
        x_hat = x_hat + visit("hook_sae_error", error)
    return visit("hook_sae_output", x_hat)


def _visitor(prefix: str, sae_hooks: Mapping[str, list[HookFn]]
             ) -> Callable[[str, Tensor], Tensor]:
    def visit(point: str, tensor: Tensor) -> Tensor:
        name = f"{prefix}.{point}"
        for fn in sae_hooks.get(name, ()):
            replaced = fn(tensor, name)
            if replaced is not None:
                check_replacement(replaced, tensor, name)
                tensor = replaced
        return tensor
    return visit


# --- checks before the run -------------------------------------------------------------------

def check_saes(model: nn.Module, ids: Tensor, saes: Any, points: Mapping[str, Any]) -> list[SAE]:
    """The dictionaries, each refused by name unless it fits the model: its points exist (a
    transcoder's input before its output), one dictionary a point, and its widths are the
    points' (read from a one-token run), on the model's device."""
    saes = _as_list(saes)
    order = {name: position for position, name in enumerate(points)}
    outputs: set[str] = set()
    for sae in saes:
        check_points(sae, order)
        if sae.cfg.hook_name_out in outputs:
            raise InputError(f"two dictionaries write to {sae.cfg.hook_name_out}; splice one "
                             f"per hook point")
        outputs.add(sae.cfg.hook_name_out)
    check_widths(model, ids, saes)
    return saes


def check_points(sae: SAE, order: Mapping[str, int]) -> None:
    cfg = sae.cfg
    if cfg.hook_name is None:
        raise InputError(f"the {cfg.architecture} dictionary has no metadata.hook_name: set "
                         f"sae.cfg.metadata.hook_name to the point it reads")
    for name in (cfg.hook_name, cfg.hook_name_out):
        if name not in order:
            raise InputError(unknown_name_message(name, order, "the model") +
                             f" (the {cfg.architecture} dictionary's hook)")
    if order[cfg.hook_name] > order[cfg.hook_name_out]:
        raise InputError(f"the transcoder reads {cfg.hook_name}, which the model computes after "
                         f"{cfg.hook_name_out}, where it writes")


def check_widths(model: nn.Module, ids: Tensor, saes: list[SAE]) -> None:
    """Each dictionary's d_in (and d_out) against its points' widths in a one-token run."""
    names = {name for sae in saes for name in (sae.cfg.hook_name, sae.cfg.hook_name_out)}
    stop = stop_at_layer(names, as_glass(model).config.n_layer)
    _, probe = run_with_cache(model, ids[:1, :1], sorted(names), stop)
    for sae in saes:
        cfg = sae.cfg
        for name, width in ((cfg.hook_name, cfg.d_in), (cfg.hook_name_out, cfg.width_out)):
            activation = probe[name]
            found = activation.shape[-1]
            if cfg.reshape_activations == "hook_z":
                if activation.dim() != 4:
                    raise InputError(f"the dictionary reads heads side by side "
                                     f"(reshape_activations 'hook_z'), but {name} has no "
                                     f"head axis: give it a (batch, pos, head, d_head) point")
                found = activation.shape[-2] * activation.shape[-1]  # heads x d_head
            if found != width:
                raise InputError(f"the {cfg.architecture} dictionary for {name} takes width "
                                 f"{width}, but {name} is {found} wide in this model")
            if sae.W_enc.device != activation.device:
                raise InputError(f"the dictionary for {name} is on {sae.W_enc.device}, the "
                                 f"model on {activation.device}: move it with sae.to(...)")


def split_hooks(hooks: Any, points: Mapping[str, Any], sae_names: list[str],
                use_error_term: bool) -> tuple[list, dict[str, list[HookFn]]]:
    """The caller's (name or predicate, fn) pairs -> (the model's pairs, for run_with_hooks,
    which checks them; the dictionaries' point name -> fns)."""
    if hooks is None or isinstance(hooks, str | Mapping) or not isinstance(hooks, Iterable):
        raise InputError(f"hooks must be a list of (name, fn) pairs, got {type(hooks).__name__}")
    model_hooks, sae_hooks = [], {}
    for pair in hooks:
        if not (isinstance(pair, tuple) and len(pair) == 2):
            raise InputError(f"a hook is a (name, fn) pair with fn(tensor, name), got "
                             f"{pair!r:.80}")
        where, fn = pair
        if callable(where):
            check_hook_fn(fn, pair)
            mine = [name for name in sae_names if where(name)]
            model_hooks += [(name, fn) for name in points if where(name)]
            if not mine and not any(where(name) for name in points):
                raise InputError(f"the names filter {where!r:.60} of a hook selects no hook "
                                 f"point of the model or its dictionaries")
        elif isinstance(where, str) and ".hook_sae_" in where:
            check_hook_fn(fn, pair)
            _check_sae_name(where, sae_names, use_error_term)
            mine = [where]
        else:
            model_hooks.append(pair)
            mine = []
        for name in mine:
            sae_hooks.setdefault(name, []).append(fn)
    return model_hooks, sae_hooks


def _check_sae_name(name: str, sae_names: list[str], use_error_term: bool) -> None:
    if name in sae_names:
        return
    if name.endswith(".hook_sae_error") and not use_error_term:
        raise InputError(f"{name} exists only with use_error_term=True")
    raise InputError(unknown_name_message(name, sae_names, "the spliced dictionaries"))


def _as_list(saes: Any) -> list[SAE]:
    saes = [saes] if isinstance(saes, SAE) else saes
    if isinstance(saes, str | Mapping | Tensor) or not isinstance(saes, Iterable):
        raise InputError(f"saes must be an SAE or a list of them, got {type(saes).__name__}")
    saes = list(saes)
    for sae in saes:
        if not isinstance(sae, SAE):
            raise InputError(f"saes must hold glassgpt.interp.sae.SAE dictionaries (SAE.load), "
                             f"got {type(sae).__name__}")
    return saes
