"""Run a glassgpt model with its hook points read or replaced: `run_with_cache`, `run_with_hooks`.

A hook is `fn(tensor, name)`; it may return a replacement for the activation (a patch, an
ablation) or None to leave it. Hooks live only for one call: they are removed afterwards, also
when the forward raises. Both run the model in eval mode (no dropout: a patched and an unpatched
run must differ only by the patch) and give the model back the mode it had.

Gradients at hook points: a backward hook `fn(grad, name)` (`run_with_hooks(bwd_hooks=...)`)
is tied to the run's autograd graph, not to the module, so it fires whenever the caller
backpropagates through the returned output, after the call has returned;
`run_with_cache(incl_bwd=True, metric=fn)` runs the backward itself and keeps each point's
gradient under TransformerLens's `{name}_grad`.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from glassgpt.errors import InputError, ModelError
from glassgpt.hooks import HookFn, HookPoint, attached, check_replacement
from glassgpt.inputs import check_id_tensor
from glassgpt.interp.core.cache import ActivationCache, unknown_name_message
from glassgpt.model import eval_mode

NamesFilter = str | Iterable[str] | Callable[[str], bool] | None


def as_glass(model: object) -> object:
    """The glassgpt GPT a caller means: `model` itself, or the glass model a HookedGPT wraps
    (`model.glass`), so that every function of glassgpt.interp takes either."""
    inner = getattr(model, "glass", None) if isinstance(model, nn.Module) else None
    return inner if isinstance(inner, nn.Module) else model


def hook_points(model: nn.Module) -> dict[str, HookPoint]:
    """Every hook point of a glassgpt model (or a HookedGPT's), by its TransformerLens name, in
    forward order."""
    model = as_glass(model)
    if not isinstance(model, nn.Module):
        raise ModelError(f"glassgpt.interp takes a glassgpt GPT, got {type(model).__name__}")
    points = {m.name: m for m in model.modules() if isinstance(m, HookPoint)}
    if not points:
        raise ModelError(f"{type(model).__name__} has no hook points: glassgpt.interp takes a "
                         "glassgpt GPT")
    return points


def select_names(points: Mapping[str, HookPoint], names: NamesFilter) -> list[str]:
    """A names filter (None = all, one name, several, or a predicate) -> the names it selects."""
    if names is None:
        return list(points)
    if callable(names):
        return [n for n in points if names(n)]
    if isinstance(names, Mapping | Tensor) or not isinstance(names, str | Iterable):
        raise InputError(f"names must be None, a hook name, a list of names or a predicate "
                         f"name -> bool, got {type(names).__name__}")
    wanted = [names] if isinstance(names, str) else list(names)
    for name in wanted:
        if not isinstance(name, str) or name not in points:
            raise InputError(unknown_name_message(name, points, "the model"))
    return wanted


def check_hook_fn(fn: object, pair: object) -> None:
    """A hook is called as fn(tensor, name): refuse one that cannot take those two arguments
    now, rather than with a TypeError from inside the forward pass."""
    if not callable(fn):
        raise InputError(f"a hook is a (name, fn) pair with fn(tensor, name), got {pair!r:.80}")
    try:
        inspect.signature(fn).bind(None, None)
    except TypeError as error:
        raise InputError(f"a hook function is called as fn(tensor, name); {fn!r:.60} cannot "
                         f"be: {error}") from None
    except ValueError:  # a builtin without a signature: it is tried as it is
        pass


def expand_hooks(points: Mapping[str, HookPoint],
                 hooks: Iterable[tuple[str, HookFn]]) -> list[tuple[str, HookFn]]:
    """(name or predicate, fn) pairs -> (name, fn) pairs, a predicate standing for every name it
    selects (as TransformerLens's hooks take a names filter)."""
    if hooks is None or isinstance(hooks, str | Mapping) or not isinstance(hooks, Iterable):
        raise InputError(f"hooks must be a list of (name, fn) pairs, got "
                         f"{type(hooks).__name__}")
    expanded, checked = [], set()
    for pair in hooks:
        if not (isinstance(pair, tuple) and len(pair) == 2):
            raise InputError(f"a hook is a (name, fn) pair with fn(tensor, name), got "
                             f"{pair!r:.80}")
        where, fn = pair
        if id(fn) not in checked:  # run_with_cache hands one fn for every point it keeps
            check_hook_fn(fn, pair)
            checked.add(id(fn))
        if callable(where):
            names = select_names(points, where)
            if not names:
                raise InputError(f"the names filter {where!r:.60} of a hook selects no hook "
                                 "point of the model")
        elif isinstance(where, str):
            names = select_names(points, where)
        else:
            raise InputError(f"a hook's name is a hook point's name or a predicate "
                             f"name -> bool, got {type(where).__name__}")
        expanded.extend((name, fn) for name in names)
    return expanded


# The models this thread is running with hooks attached. A hook that starts a run of the same
# model would find its own hook attached again and recurse without end, so that is refused.
_running = threading.local()


@contextmanager
def one_run_at_a_time(model: nn.Module) -> Iterator[None]:
    running = _running.__dict__.setdefault("models", set())
    if id(model) in running:
        raise InputError("run_with_cache / run_with_hooks was called from inside a hook of a run "
                         "of the same model; take what the hook needs from its tensor, or run "
                         "again after this run returns")
    running.add(id(model))
    try:
        yield
    finally:
        running.discard(id(model))


def check_run_ids(ids: object) -> None:
    """ids must be (B, T) token ids with B >= 1 and T >= 1; the model checks the rest (its
    block_size, its vocabulary)."""
    check_id_tensor(ids)
    if ids.dim() != 2 or ids.shape[0] < 1 or ids.shape[1] < 1:
        raise InputError(f"token ids must be (batch, time) with at least one row and one "
                         f"token, got shape {tuple(ids.shape)}")


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
    for depth, stream in model.layers(ids):
        if depth == stop_at_layer:
            return stream  # (B, T, C); closing the generator skips the rest
    raise AssertionError("unreachable: layers yields n_layer + 1 streams")


def _watch(tensor: Tensor, name: str) -> None:
    return None


def watching_every_path(points: Mapping[str, HookPoint]) -> list[tuple[str, HookFn]]:
    """Do-nothing hooks on every point whose being watched changes how its activation is
    computed (the attention pattern: the explicit path; a LayerNorm's x_hat: the norm in steps).
    Every run of glassgpt.interp carries them, so a patched run and its clean run compute alike
    (patching a run with its own cache gives exactly 1)."""
    return [(name, _watch) for name, point in points.items() if point.decides_path]


def run_with_hooks(model: nn.Module, ids: Tensor,
                   hooks: Iterable[tuple[str, HookFn]] = (),
                   stop_at_layer: int | None = None,
                   bwd_hooks: Iterable[tuple[str, HookFn]] = ()) -> Tensor:
    """ids (B, T) -> logits (B, T, V), with each `fn(tensor, name)` run at its hook point (its
    return value, when not None, replaces the activation). Attention runs its explicit path
    and LayerNorm its written-out one (`watching_every_path`). `stop_at_layer` l (as in
    TransformerLens) runs only the first l blocks and returns the residual stream (B, T, C).

    `bwd_hooks` (name, fn) pairs: `fn(grad, name)` is called with the gradient at that point's
    output (after the forward hooks: the tensor the model went on with) when the caller
    backpropagates through the output, e.g. `metric(logits).backward()`; a tensor it returns
    replaces the gradient. They need gradients enabled (not under torch.no_grad())."""
    model = as_glass(model)  # a HookedGPT runs its glass model
    points = hook_points(model)  # first: a model that is none is refused before all else
    check_run_ids(ids)
    hooks = expand_hooks(points, hooks)
    gradient_hooks = [(name, gradient_watcher(fn)) for name, fn in expand_hooks(points, bwd_hooks)]
    if gradient_hooks and not torch.is_grad_enabled():
        raise InputError("bwd_hooks need gradients, but this run is under torch.no_grad() (or "
                         "inference mode): run it with gradients enabled")
    # The gradient watchers go last, so they see the activation the forward hooks left.
    with one_run_at_a_time(model), eval_mode(model), \
            attached(points, [*watching_every_path(points), *hooks, *gradient_hooks]):
        return logits_of(model, ids, stop_at_layer)


def gradient_watcher(fn: HookFn) -> HookFn:
    """A backward hook fn(grad, name) as a forward hook that hangs it on the activation's
    autograd node: it fires in whatever backward later passes through this run's graph."""
    def watch(tensor: Tensor, name: str) -> Tensor | None:
        tracked = differentiable(tensor)
        tracked.register_hook(lambda grad: checked_gradient(fn(grad, name), grad, name))
        return None if tracked is tensor else tracked
    return watch


def differentiable(tensor: Tensor) -> Tensor:
    """`tensor`, or where nothing upstream requires a gradient (frozen parameters) the same
    values as a leaf that does: the gradient at an activation does not depend on whether the
    weights before it are trainable."""
    if tensor.requires_grad:
        return tensor
    if not tensor.is_floating_point():
        raise InputError(f"no gradient at a {tensor.dtype} activation")
    return tensor.detach().requires_grad_(True)


def checked_gradient(replaced: Tensor | None, grad: Tensor, name: str) -> Tensor | None:
    """A backward hook's return: None leaves the gradient, a tensor shaped as it replaces it."""
    if replaced is not None:
        check_replacement(replaced, grad, f"{name} (backward)")
    return replaced


# The points whose layout is (batch, pos, head, d_head): the ones zero_heads can switch off.
HEAD_VECTOR_POINTS = ("attn.hook_z", "attn.hook_q", "attn.hook_k", "attn.hook_v",
                      "attn.hook_rot_q", "attn.hook_rot_k")


def zero_heads(*heads: int) -> HookFn:
    """A hook for `blocks.{l}.attn.hook_z` that switches the given heads off: their outputs
    are 0 before the output projection, as if their slice of W_O were removed. It also takes
    the other (batch, pos, head, d_head) points (q, k, v, rot_q, rot_k), and nothing else."""
    for head in heads:
        if isinstance(head, bool) or not isinstance(head, int):
            raise InputError(f"zero_heads takes head indices (ints), got {head!r:.40}")

    def switch_off(z: Tensor, name: str) -> Tensor:  # z (B, T, H, d)
        if not name.endswith(HEAD_VECTOR_POINTS):
            raise InputError(f"zero_heads switches heads off at a point with a head axis "
                             f"(batch, pos, head, d_head): {', '.join(HEAD_VECTOR_POINTS)}; "
                             f"{name} has none")
        for head in heads:
            if not 0 <= head < z.shape[2]:
                raise InputError(f"head {head} does not exist at {name}: heads 0..{z.shape[2] - 1}")
        z = z.clone()
        z[:, :, list(heads)] = 0.0
        return z
    return switch_off


def run_with_cache(model: nn.Module, ids: Tensor, names: NamesFilter = None,
                   stop_at_layer: int | None = None, incl_bwd: bool = False,
                   metric: Callable[[Tensor], Tensor] | None = None
                   ) -> tuple[Tensor, ActivationCache]:
    """ids (B, T) -> (logits (B, T, V), cache): every activation selected by `names` (None: all
    of them), detached, under its TransformerLens name. With `stop_at_layer` l, only the first
    l blocks run and the residual stream (B, T, C) comes back in place of the logits (what a
    look at early layers costs: no later block, no LM head).

    With `incl_bwd=True` and `metric` (the run's output -> a scalar tensor), the run is
    differentiated: the cache also holds d metric / d activation under `{name}_grad` for each
    selected point (zeros where the metric does not depend on it). The backward is taken with
    torch.autograd.grad, so no parameter's .grad is touched. Without it the run is no_grad."""
    points = hook_points(model)
    selected = select_names(points, names)
    if not incl_bwd:
        if metric is not None:
            raise InputError("metric is what run_with_cache differentiates with incl_bwd=True; "
                             "pass incl_bwd=True, or no metric")
        with torch.no_grad():
            logits, store = forward_keeping(model, ids, selected, stop_at_layer)
        return logits, ActivationCache(in_order(points, store), ids=ids, model=model)
    if not callable(metric):
        raise InputError(f"incl_bwd=True needs metric=fn, fn(logits) -> a scalar tensor to "
                         f"differentiate, got {metric!r:.40}")
    with torch.enable_grad():  # asked for: a gradient, even from inside a no_grad block
        logits, store = forward_keeping(model, ids, selected, stop_at_layer)
        grads = gradients_of(metric(logits), store)
    activations = in_order(points, {name: t.detach() for name, t in store.items()})
    cache = {**activations, **{f"{name}_grad": grads[name] for name in activations}}
    return logits.detach(), ActivationCache(cache, ids=ids, model=model)


def forward_keeping(model: nn.Module, ids: Tensor, selected: list[str],
                    stop_at_layer: int | None) -> tuple[Tensor, dict[str, Tensor]]:
    """One run keeping each selected activation: detached under no_grad, else the live tensor
    the model went on with (a leaf where nothing before it is trainable), to differentiate."""
    store: dict[str, Tensor] = {}
    grad = torch.is_grad_enabled()

    def keep(tensor: Tensor, name: str) -> Tensor | None:
        if not grad:
            store[name] = tensor.detach()
            return None
        store[name] = differentiable(tensor)
        return None if store[name] is tensor else store[name]

    logits = run_with_hooks(model, ids, [(name, keep) for name in selected], stop_at_layer)
    return logits, store


def in_order(points: Mapping[str, HookPoint], store: Mapping[str, Tensor]) -> dict[str, Tensor]:
    return {name: store[name] for name in points if name in store}


def gradients_of(value: object, live: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """d value / d each live activation (zeros for one the value does not depend on)."""
    if not isinstance(value, Tensor) or value.numel() != 1 or not value.is_floating_point():
        got = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
        raise InputError(f"the metric must return a scalar float tensor to differentiate, got "
                         f"{got}")
    if not value.requires_grad:
        raise InputError("the metric's value does not depend on the run's activations (it "
                         "has no gradient): compute it from the logits it is handed")
    names = list(live)
    grads = torch.autograd.grad(value.reshape(()), [live[n] for n in names], allow_unused=True)
    return {name: (torch.zeros_like(live[name]) if grad is None else grad.detach())
            for name, grad in zip(names, grads, strict=True)}
