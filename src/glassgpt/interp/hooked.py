"""Run a glassgpt model with its hook points read or replaced: `run_with_cache`, `run_with_hooks`.

A hook is `fn(tensor, name)`; it may return a replacement for the activation (a patch, an
ablation) or None to leave it. Hooks live only for one call: they are removed afterwards, also
when the forward raises. Both run the model in eval mode (no dropout: a patched and an unpatched
run must differ only by the patch) and give the model back the mode it had.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import ExitStack, contextmanager

import torch
from torch import Tensor, nn

from glassgpt.errors import InputError, ModelError
from glassgpt.hooks import HookPoint
from glassgpt.model import eval_mode

HookFn = Callable[[Tensor, str], Tensor | None]
NamesFilter = str | Iterable[str] | Callable[[str], bool] | None


class ActivationCache(Mapping[str, Tensor]):
    """Hook name -> the activation a run produced there (detached). A missing name says which
    names the model has."""

    def __init__(self, tensors: dict[str, Tensor]):
        self._tensors = tensors

    def __getitem__(self, name: str) -> Tensor:
        if name not in self._tensors:
            raise KeyError(unknown_name_message(name, self._tensors, "this cache"))
        return self._tensors[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    def __repr__(self) -> str:
        return f"ActivationCache({len(self)} activations)"


def hook_points(model: nn.Module) -> dict[str, HookPoint]:
    """Every hook point of a glassgpt model, by its TransformerLens name, in forward order."""
    points = {m.name: m for m in model.modules() if isinstance(m, HookPoint)}
    if not points:
        raise ModelError(f"{type(model).__name__} has no hook points: glassgpt.interp takes a "
                         "glassgpt GPT")
    return points


def unknown_name_message(name: object, known: Iterable[str], where: str) -> str:
    known = list(known)
    close = difflib.get_close_matches(str(name), known, n=3)
    hint = f"; did you mean {', '.join(close)}?" if close else f"; it has {len(known)} names"
    return f"no hook point {name!r} in {where}{hint}"


def select_names(points: Mapping[str, HookPoint], names: NamesFilter) -> list[str]:
    """A names filter (None = all, one name, several, or a predicate) -> the names it selects."""
    if names is None:
        return list(points)
    if callable(names):
        return [n for n in points if names(n)]
    wanted = [names] if isinstance(names, str) else list(names)
    for name in wanted:
        if not isinstance(name, str) or name not in points:
            raise InputError(unknown_name_message(name, points, "the model"))
    return wanted


@contextmanager
def attached(model: nn.Module, hooks: Iterable[tuple[str, HookFn]]) -> Iterator[None]:
    """Attach `(name, fn)` hooks to the model's points for the duration of the block."""
    points = hook_points(model)
    hooks = list(hooks)
    for pair in hooks:
        if not (isinstance(pair, tuple) and len(pair) == 2 and callable(pair[1])):
            raise InputError(f"a hook is a (name, fn) pair with fn(tensor, name), got {pair!r}")
        select_names(points, pair[0])
    with ExitStack() as stack:
        for name, fn in hooks:
            handle = points[name].register_forward_hook(_as_forward_hook(fn, name))
            stack.callback(handle.remove)
        yield


def _as_forward_hook(fn: HookFn, name: str) -> Callable:
    def forward_hook(module: nn.Module, inputs: tuple, output: Tensor) -> Tensor | None:
        replaced = fn(output, name)
        if replaced is not None and (not isinstance(replaced, Tensor)
                                     or replaced.shape != output.shape):
            got = tuple(replaced.shape) if isinstance(replaced, Tensor) else type(replaced)
            raise InputError(f"the hook on {name} must return None or a tensor of shape "
                             f"{tuple(output.shape)}, got {got}")
        return replaced
    return forward_hook


def logits_of(model: nn.Module, ids: Tensor, stop_at_layer: int | None = None) -> Tensor:
    """The logits (B, T, V) of ids, or with `stop_at_layer` l the residual stream (B, T, C)
    after the first l blocks (0: the embeddings), the later blocks and the head never run."""
    if stop_at_layer is None:
        logits, _ = model(ids)  # (B, T, V)
        return logits
    n_layer = model.config.n_layer
    if isinstance(stop_at_layer, bool) or not isinstance(stop_at_layer, int) \
            or not 0 <= stop_at_layer <= n_layer:
        raise InputError(f"stop_at_layer must be an int in [0, n_layer = {n_layer}], got "
                         f"{stop_at_layer!r:.40}")
    for depth, stream, _ in model.layers(ids):
        if depth == stop_at_layer:
            return stream  # (B, T, C); closing the generator skips the rest
    raise AssertionError("unreachable: layers yields n_layer + 1 streams")


def _watch(tensor: Tensor, name: str) -> None:
    return None


def watching_every_path(model: nn.Module) -> list[tuple[str, HookFn]]:
    """Do-nothing hooks on every point whose being watched changes how its activation is
    computed (the attention pattern: the explicit path; a LayerNorm's x_hat: the norm in steps).
    Every run of glassgpt.interp carries them, so a patched run and its clean run compute alike
    (patching a run with its own cache gives exactly 1)."""
    return [(name, _watch) for name, point in hook_points(model).items() if point.decides_path]


def run_with_hooks(model: nn.Module, ids: Tensor,
                   hooks: Iterable[tuple[str, HookFn]] = (),
                   stop_at_layer: int | None = None) -> Tensor:
    """ids (B, T) -> logits (B, T, V), with each `fn(tensor, name)` run at its hook point (its
    return value, when not None, replaces the activation). Attention runs its explicit path
    and LayerNorm its written-out one (`watching_every_path`). `stop_at_layer` l (as in
    TransformerLens) runs only the first l blocks and returns the residual stream (B, T, C)."""
    with eval_mode(model), attached(model, [*watching_every_path(model), *hooks]):
        return logits_of(model, ids, stop_at_layer)


def zero_heads(*heads: int) -> HookFn:
    """A hook for `blocks.{l}.attn.hook_z` that switches the given heads off: their outputs
    are 0 before the output projection, as if their slice of W_O were removed."""
    def switch_off(z: Tensor, name: str) -> Tensor:  # z (B, T, H, d)
        for head in heads:
            if not 0 <= head < z.shape[2]:
                raise InputError(f"head {head} does not exist at {name}: heads 0..{z.shape[2] - 1}")
        z = z.clone()
        z[:, :, list(heads)] = 0.0
        return z
    return switch_off


def run_with_cache(model: nn.Module, ids: Tensor, names: NamesFilter = None,
                   stop_at_layer: int | None = None) -> tuple[Tensor, ActivationCache]:
    """ids (B, T) -> (logits (B, T, V), cache): every activation selected by `names` (None: all
    of them), detached, under its TransformerLens name. With `stop_at_layer` l, only the first
    l blocks run and the residual stream (B, T, C) comes back in place of the logits (what a
    look at early layers costs: no later block, no LM head)."""
    store: dict[str, Tensor] = {}

    def keep(tensor: Tensor, name: str) -> None:
        store[name] = tensor.detach()

    selected = select_names(hook_points(model), names)
    with torch.no_grad():
        logits = run_with_hooks(model, ids, [(name, keep) for name in selected], stop_at_layer)
    ordered = {name: store[name] for name in hook_points(model) if name in store}
    return logits, ActivationCache(ordered)
