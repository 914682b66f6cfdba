"""Hook points: named, do-nothing modules at the activations a reader asks about.

A hook point returns its input unchanged. It exists so that a cache, a patch or an ablation can
reach inside the model without a new forward argument: `glassgpt.interp` attaches a PyTorch
forward hook to the point, reads the tensor or returns a replacement, and removes the hook again.
Unused, a point is one module call that returns its argument. Attaching a hook `fn(tensor, name)`
by name lives here too (`attached`, `hooks_attached`), so that decoding, below interp, can run
hooks at every step of a sampling.

The names are TransformerLens's, so that its tutorials carry over: `hook_embed`,
`blocks.0.attn.hook_q` (batch, pos, head, d_head), `blocks.0.attn.hook_pattern`
(batch, head, query, key), `blocks.0.mlp.hook_post`, `ln_final.hook_normalized`, ... A point's
name is its module path, with two of glassgpt's module names spelled as TransformerLens does
(`ffn` -> `mlp`, `ln_f` -> `ln_final`); `GPT` names its points once, when it is built.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import ExitStack, contextmanager

import torch
from torch import Tensor, nn

from glassgpt.errors import InputError
from glassgpt.hooknames import parse_hook_name

# A hook: fn(tensor, name) -> a replacement for the activation, or None to leave it.
HookFn = Callable[[Tensor, str], Tensor | None]

# glassgpt's module name -> TransformerLens's, where they differ (state-dict keys keep ours).
LENS_MODULE_NAMES = {"ffn": "mlp", "ln_f": "ln_final"}


class HookPoint(nn.Module):
    """An activation with a name: identity, unless a hook attached by glassgpt.interp replaces it.

    `transpose=(a, b)`: hooks see x.transpose(a, b) (to show TransformerLens's layout, e.g.
    (B, T, H, d) of a tensor the model keeps as (B, H, T, d)), and a replacement is turned back;
    with no hook attached, nothing is transposed.
    """

    def __init__(self, transpose: tuple[int, int] | None = None,
                 decides_path: bool = False) -> None:
        super().__init__()
        self.name = ""  # set by name_hook_points once the point's place in the model is known
        # What a hook may keep between calls (TransformerLens's `hook.ctx`: a hook that scores
        # a pattern can leave its number here for the caller to read after the run).
        self.ctx: dict = {}
        self.transpose = transpose
        # True where a hook changes how the owner computes (the fused kernel never forms the
        # activation, so a watched point takes the written-out path): glassgpt.interp watches
        # these in every run, so that all its runs compute alike.
        self.decides_path = decides_path

    def __call__(self, x: Tensor) -> Tensor:
        # With no hook attached a point is two dictionary tests: it skips nn.Module's call
        # machinery (global module hooks are not run here), which costs ~2 us a point a step,
        # measurable in a small model's decoding. A `forward` set on the instance watches too
        # (nnsight's, see `_instance_forward_idle`): the call then goes through nn.Module to it.
        if not self._forward_hooks and ("forward" not in self.__dict__
                                        or self._instance_forward_idle()):
            return x
        if self.transpose is None:
            return super().__call__(x)
        return super().__call__(x.transpose(*self.transpose)).transpose(*self.transpose)

    def forward(self, x: Tensor) -> Tensor:
        return x

    @property
    def active(self) -> bool:
        """Whether someone is looking: a forward hook, or a watching `forward` set on the
        instance (nnsight's, in a trace). Code that would skip computing this activation (the
        fused attention kernel never forms the pattern) computes it then."""
        return bool(self._forward_hooks) or ("forward" in self.__dict__
                                             and not self._instance_forward_idle())

    def _instance_forward_idle(self) -> bool:
        """Whether the `forward` set on this instance watches nothing now. nnsight (0.8) sees a
        module by putting its own forward there, and leaves it for good after its traces; its
        state beside it (`__nnsight__`) tells whether a trace is running. Outside one the point
        is idle again (the owner keeps its fused path, the plain forward its speed). Any other
        instance forward, or a state of another shape, counts as watching."""
        state = self.__dict__.get("__nnsight__")
        tracing = getattr(state, "active", None)
        route = tracing() if callable(tracing) else None
        return isinstance(route, tuple) and bool(route) and route[0] is None

    def layer(self) -> int:
        """The index of the block this point is in (`blocks.3.attn.hook_z` -> 3), as
        TransformerLens's `hook.layer()`; a point outside the blocks has none."""
        layer = parse_hook_name(self.name).layer
        if layer is None:
            raise InputError(f"hook point {self.name!r} is not inside a block: it has no layer")
        return layer

    def extra_repr(self) -> str:
        return self.name


def add_hook_points(module: nn.Module, *names: str, **options: object) -> None:
    """Give `module` a HookPoint under each name (a child module: `named_modules` and
    `print(model)` show it), kept in the instance dict as well, so that reading it in a forward
    skips `nn.Module.__getattr__` (~0.3 us a read: per point, per layer, per decoding step).
    `options` are HookPoint's (`transpose`, `decides_path`)."""
    for name in names:
        point = HookPoint(**options)
        module.add_module(name, point)
        module.__dict__[name] = point


def lens_name(module_path: str) -> str:
    """`blocks.0.ffn.hook_pre` -> `blocks.0.mlp.hook_pre`: the TransformerLens spelling."""
    return ".".join(LENS_MODULE_NAMES.get(part, part) for part in module_path.split("."))


def name_hook_points(model: nn.Module) -> dict[str, HookPoint]:
    """Give every HookPoint in `model` its TransformerLens name; return them by name."""
    points = {}
    for path, module in model.named_modules():
        if isinstance(module, HookPoint):
            module.name = lens_name(path)
            points[module.name] = module
    return points


@contextmanager
def recorded(*modules: nn.Module) -> Iterator[list[Tensor]]:
    """Inside the block, every output of `modules` is appended to the list it yields, in the
    order they ran; the hooks are gone after it, also on an error. A hook point watched so is
    active: attention then takes its explicit path, so its pattern is formed to be read.
    (glassgpt.interp's run_with_cache is this, by name, for a whole model.)"""
    seen: list[Tensor] = []

    def keep(module: nn.Module, inputs: tuple, output: Tensor) -> None:
        seen.append(output)

    handles = [module.register_forward_hook(keep) for module in modules]
    try:
        yield seen
    finally:
        for handle in handles:
            handle.remove()


# --- attaching hooks by name -----------------------------------------------------------------
# Here, in the glass, so that every layer above can attach a hook the same way: glassgpt.interp
# for one run, glassgpt.decoding for every step of a sampling.

@contextmanager
def attached(points: Mapping[str, HookPoint],
             hooks: Iterable[tuple[str, HookFn]]) -> Iterator[None]:
    """Attach `(name, fn)` hooks (names already checked against `points`) for the duration of
    the block; they are removed after it, also on an error."""
    with ExitStack() as stack:
        for name, fn in hooks:
            handle = points[name].register_forward_hook(_as_forward_hook(fn, name))
            stack.callback(handle.remove)
        yield


def _as_forward_hook(fn: HookFn, name: str) -> Callable:
    def forward_hook(module: nn.Module, inputs: tuple, output: Tensor) -> Tensor | None:
        replaced = fn(output, name)
        if replaced is not None:
            check_replacement(replaced, output, name)
        return replaced
    return forward_hook


def check_replacement(replaced: object, output: Tensor, name: str) -> None:
    """A hook's replacement must be what the model would have computed there in all but its
    values: same shape, dtype and device (a silent cast of int64 or bf16 would hide the
    mistake), and no NaN (a NaN carried on poisons every number after it)."""
    want = f"a tensor of shape {tuple(output.shape)}, {output.dtype} on {output.device}"
    if not isinstance(replaced, Tensor):
        raise InputError(f"the hook on {name} must return None or {want}, got "
                         f"{type(replaced).__name__}")
    if replaced.shape != output.shape or replaced.dtype != output.dtype \
            or replaced.device != output.device:
        raise InputError(f"the hook on {name} must return None or {want}, got shape "
                         f"{tuple(replaced.shape)}, {replaced.dtype} on {replaced.device}")
    if replaced.is_floating_point() and torch.isnan(replaced).any():
        raise InputError(f"the hook on {name} returned a tensor holding NaN")


def named_hooks(model: nn.Module, hooks: object) -> list[tuple[str, HookFn]]:
    """`hooks` as (name, fn) pairs on `model`'s points, each name one of its points and each fn
    callable, refused by name (InputError) before anything is attached."""
    if hooks is None or isinstance(hooks, str | Mapping) or not isinstance(hooks, Iterable):
        raise InputError(f"hooks must be a list of (name, fn) pairs, got {type(hooks).__name__}")
    points = {m.name for m in model.modules() if isinstance(m, HookPoint)}
    pairs = []
    for pair in hooks:
        if not (isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], str)
                and callable(pair[1])):
            raise InputError(f"a hook is a (name, fn) pair with fn(tensor, name), got "
                             f"{pair!r:.80}")
        if pair[0] not in points:
            raise InputError(f"the model has no hook point {pair[0]!r:.80} (e.g. "
                             f"{', '.join(sorted(points)[:3])})")
        pairs.append(pair)
    return pairs


@contextmanager
def hooks_attached(model: nn.Module, hooks: Iterable[tuple[str, HookFn]]) -> Iterator[None]:
    """`named_hooks(model, hooks)` attached to `model`'s points for the duration of the block."""
    pairs = named_hooks(model, hooks)
    points = {m.name: m for m in model.modules() if isinstance(m, HookPoint)}
    with attached(points, pairs):
        yield
