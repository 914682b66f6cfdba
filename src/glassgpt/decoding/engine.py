"""The decoding engine interface, and the reference engine: the plain model, run eagerly.

An engine runs the two calls that incremental decoding is made of, with a KV cache:
    prefill(idx (B, T))        -> logits (B, V) after the prompt, filling positions 0..T-1
    step(token (B, 1), pos)    -> logits (B, V) after `token`, written at position `pos`
    pick(logits, ...)          -> the next token (B, 1), drawn as `SamplingConfig` says
and `recompute(window)`, the uncached call used once a sequence outgrows the position table.
Every engine gives exactly the tokens of `EagerEngine`, which calls `GPT.forward` and nothing
else; the tests hold each engine to that.

Faster engines never change the model a user passed in: they work on a *twin*, a second module
tree that shares every weight tensor with the model (so it costs no memory and sees every update
of the weights) but whose modules may be of speed-tuned subclasses. A model keeps its twin while
its tensors stay the same (moving it to another device or dtype makes a new one), so a compiled
step keeps serving one model from call to call. (Hooks registered on the model after its twin
was made do not run in the twin: decode with the eager engine to watch the model's own calls.)
"""

from __future__ import annotations

import copy
import itertools
import types
import weakref
from collections.abc import Callable, Hashable
from typing import Any

import torch
from torch import Tensor, nn

from glassgpt.config import SamplingConfig
from glassgpt.decoding.sampling import pick_token


class EagerEngine:
    """The reference: `GPT.forward` with its KV cache, exactly as a student would call it."""

    name = "eager"

    def __init__(self, model: Any):
        self.model = model

    def start(self, batch_size: int, max_len: int) -> None:
        """Allocate the KV cache for `batch_size` rows of up to `max_len` positions."""
        self.model.setup_kv_cache(batch_size, max_len)

    def prefill(self, idx: Tensor) -> Tensor:
        """Logits (B, V) after the prompt idx (B, T), whose keys and values fill the cache."""
        return self.model(idx, start_pos=0, last_only=True, check_ids=False)[0][:, -1]

    def step(self, token: Tensor, pos: int) -> Tensor:
        """Logits (B, V) after token (B, 1) at position `pos`; the cache holds the ones before."""
        return one_token_logits(self.model, token, pos)

    def pick(self, logits: Tensor, all_finite: Tensor, sampling: SamplingConfig,
             generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
        """The next token (B, 1) from logits (B, V), and `all_finite` updated (`pick_token`)."""
        return pick_token(logits, all_finite, sampling, generator)

    def recompute(self, window: Tensor) -> Tensor:
        """Logits (B, V) after the last position of window (B, T), without the cache."""
        return self.model(window, last_only=True, check_ids=False)[0][:, -1]

    def close(self) -> None:
        self.model.remove_kv_cache()


def one_token_logits(model: Any, token: Tensor, pos: int) -> Tensor:
    """Logits (B, V) after token (B, 1) at `pos`: the step that compiled engines compile."""
    return model(token, start_pos=pos, last_only=True, check_ids=False)[0][:, -1]


def model_kind(model: nn.Module) -> Hashable:
    """Everything about a model that its compiled step's graph is specialised to: the config,
    each module's type and plain settings (`training`, `impl`, how many hooks), and each
    tensor's name, shape, strides, dtype and device; the engine's own KV cache left out.

    The compiled engines keep one step per kind, and leave out dynamo's guards on the module
    tree (`without_module_guards`): about 3,000 checks a token of what this key already
    fixed once per decoding. A model of another kind never reaches a step's graph.
    """
    modules = tuple((name, type(m), _plain_settings(m)) for name, m in model.named_modules()
                    if not _is_cache(name))
    tensors = tuple((name, tuple(t.shape), t.stride(), t.dtype, t.device)
                    for name, t in itertools.chain(model.named_parameters(),
                                                   model.named_buffers())
                    if not _is_cache(name))
    return repr(getattr(model, "config", None)), modules, tensors


def twin_kind(twin_model: nn.Module) -> Hashable:
    """`model_kind` of an engine's twin, worked out once (2.8 ms a call for shakespeare-char,
    5 ms for GPT-2): nothing but the engine touches a twin, and the KV cache it sets up is left
    out of the kind. A model whose tensors change gets a new twin, and so a new kind."""
    if twin_model not in _twin_kinds:
        _twin_kinds[twin_model] = model_kind(twin_model)
    return _twin_kinds[twin_model]


_twin_kinds: weakref.WeakKeyDictionary[nn.Module, Hashable] = weakref.WeakKeyDictionary()


def _is_cache(name: str) -> bool:
    return "kv_cache" in name.split(".")


def _plain_settings(module: nn.Module) -> tuple[tuple[str, Any], ...]:
    """A module's own plain values (and tuples of them), and the size of each of its dicts
    (its hooks)."""
    settings = []
    for key, value in vars(module).items():
        if _is_plain(value) and not _is_cache(key):
            settings.append((key, value))
        elif isinstance(value, dict) and key not in ("_parameters", "_buffers", "_modules"):
            settings.append((key, len(value)))
    return tuple(sorted(settings))


def _is_plain(value: Any) -> bool:
    if isinstance(value, tuple):
        return all(_is_plain(item) for item in value)
    return value is None or isinstance(value, bool | int | float | str)


def without_module_guards(options: dict[str, Any]) -> dict[str, Any]:
    """torch.compile `options` that also drop dynamo's guards on the module tree, where this
    torch can (2.8 and later); a step keyed by `model_kind` needs none of them."""
    skip = getattr(torch.compiler, "skip_guard_on_all_nn_modules_unsafe", None)
    return options if skip is None else {**options, "guard_filter_fn": skip}


def own_code(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` with a code object of its own, named `{name}_{n}` (the n-th such copy).

    Dynamo keeps its compiled graphs, and counts recompilations against its limit (8), per
    code object. One function compiled for every model would pass that limit in a process that
    decodes many models (a test session, a benchmark), after which dynamo silently runs the
    step uncompiled; it would also check each step against every other model's guards first.
    """
    name = f"{fn.__name__}_{next(_copies)}"
    code = fn.__code__.replace(co_name=name, co_qualname=name)
    return types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)


_copies = itertools.count(1)

Swap = Callable[[nn.Module], "type[nn.Module] | None"]


def twin(model: nn.Module, swap: Swap) -> nn.Module:
    """A copy of `model`'s module tree that shares all of its tensors, in eval mode, in which
    every module for which `swap(module)` names a subclass of its type becomes that subclass.

    The subclasses add no tensors of their own and keep every name, so the twin has the model's
    state dict. (Turning a module into a subclass in place is how `torch.nn.utils.parametrize`
    works too.)
    """
    tensors = list(itertools.chain(model.parameters(), model.buffers()))
    fingerprint = tuple((id(t), t.data_ptr(), t.dtype, t.device, t.shape) for t in tensors)
    known = _twins.setdefault(model, {})
    if swap in known and known[swap][0] == fingerprint:
        return known[swap][1]
    copied = copy.deepcopy(model, memo={id(t): t for t in tensors})
    for module in copied.modules():
        subclass = swap(module)
        if subclass is not None:
            if not issubclass(subclass, type(module)):
                raise TypeError(f"{subclass.__name__} does not extend {type(module).__name__}")
            module.__class__ = subclass
    known[swap] = (fingerprint, copied.eval())
    return copied


# model -> {swap: (fingerprint of the model's tensors, twin)}; a twin dies with its model.
_twins: weakref.WeakKeyDictionary[nn.Module, dict[Swap, tuple[Any, nn.Module]]] = \
    weakref.WeakKeyDictionary()
