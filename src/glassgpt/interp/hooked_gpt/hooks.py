"""HookedGPT's hooks as TransformerLens attaches them: `add_hook`, `hooks()`, `reset_hooks`,
`hook_dict`, `mod_dict`, each TransformerLens hook `fn(tensor, hook=point)` turned into
glassgpt's `fn(tensor, name)` (`LensHookMethods`, a part of HookedGPT: it reads the model's
`glass`, its `_points` and the hooks `_attached` so far).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

from glassgpt.errors import InputError
from glassgpt.hooks import HookPoint, lens_name
from glassgpt.interp.core.hooked import expand_hooks

LensHookFn = Callable[..., Tensor | None]  # fn(tensor, hook=point)


@dataclass(frozen=True)
class AttachedHook:
    """A hook of `add_hook` / `hooks()`: on one point, as glassgpt's fn(tensor, name)."""

    name: str
    fn: Callable[[Tensor, str], Tensor | None]
    permanent: bool
    level: int | None  # the `hooks()` context that added it; None: add_hook
    dir: str = "fwd"  # "bwd": called with the gradient at the point during a backward


def check_lens_hook_fn(fn: object) -> None:
    """A TransformerLens hook is called as fn(tensor, hook=point): refuse one that cannot be,
    now, rather than with a TypeError from inside the forward pass."""
    if not callable(fn):
        raise InputError(f"a hook is a (name, fn) pair with fn(tensor, hook=point), got "
                         f"{fn!r:.60}")
    try:
        inspect.signature(fn).bind(None, hook=None)
    except TypeError as error:
        raise InputError(f"a TransformerLens hook is called as fn(tensor, hook=point); "
                         f"{fn!r:.60} cannot be: {error}") from None
    except ValueError:  # a builtin without a signature: it is tried as it is
        pass


class LensHookMethods:
    """The hook half of HookedGPT (see the module docstring)."""

    glass: nn.Module
    _points: dict[str, HookPoint]
    _attached: list[AttachedHook]
    _context_level: int

    @property
    def hook_dict(self) -> dict[str, HookPoint]:
        """Every hook point by its TransformerLens name, in forward order."""
        return dict(self._points)

    @property
    def mod_dict(self) -> dict[str, nn.Module]:
        """Every module of the model by its TransformerLens name (`blocks.0.mlp`, ...)."""
        return {lens_name(path): module for path, module in self.glass.named_modules() if path}

    def _as_glass_pairs(self, hooks: Iterable[tuple[Any, LensHookFn]]) -> list[tuple[str, Any]]:
        """TransformerLens (name or filter, fn(tensor, hook=point)) pairs -> glassgpt's checked
        (name, fn(tensor, name)) pairs, one a hook point (a filter stands for each it picks)."""
        if hooks is None or isinstance(hooks, str | dict) or not isinstance(hooks, Iterable):
            raise InputError(f"hooks must be a list of (name, fn) pairs, got "
                             f"{type(hooks).__name__}")
        pairs = []
        for pair in hooks:
            if not (isinstance(pair, tuple) and len(pair) == 2):
                raise InputError(f"a hook is a (name, fn) pair with fn(tensor, hook=point), "
                                 f"got {pair!r:.80}")
            where, fn = pair
            check_lens_hook_fn(fn)
            pairs.append((where, self._called_with_point(fn)))
        return expand_hooks(self._points, pairs)

    def _called_with_point(self, fn: LensHookFn) -> Callable[[Tensor, str], Tensor | None]:
        """fn(tensor, hook=point) as glassgpt's fn(tensor, name). A TransformerLens hook may edit
        its tensor in place and return None (ARENA's ablations do): it is handed its own copy,
        and the copy, once edited, is the replacement. The model's own tensor is no place for
        such an edit: some are views of one split (q, k, v: autograd refuses), broadcast
        (hook_pos_embed), still read on another path (hook_mlp_in is the stream itself), or
        compared by identity (a RMSNorm's hook_scale)."""
        def call(tensor: Tensor, name: str) -> Tensor | None:
            own = tensor.clone()
            version = own._version  # bumped by every in-place edit
            replaced = fn(own, hook=self._points[name])
            if replaced is None and own._version != version:
                return own
            return replaced
        return call

    def add_hook(self, name: str | Callable[[str], bool], hook: LensHookFn, dir: str = "fwd",
                 is_permanent: bool = False, level: int | None = None) -> None:
        """Attach `hook` to the point `name` (or to each point a filter picks) for every run
        until `reset_hooks` (with including_permanent=True for a permanent one)."""
        if dir not in ("fwd", "bwd"):
            raise InputError(f"dir must be 'fwd' or 'bwd', got {dir!r:.20}")
        self._attached += [AttachedHook(point, fn, is_permanent, level, dir)
                           for point, fn in self._as_glass_pairs([(name, hook)])]

    def reset_hooks(self, clear_contexts: bool = True, direction: str = "both",
                    including_permanent: bool = False, level: int | None = None) -> None:
        """Remove the attached hooks (the permanent ones too with `including_permanent`; only
        those of one `hooks()` context with `level`), and empty every point's ctx."""
        if direction not in ("fwd", "bwd", "both"):
            raise InputError(f"direction must be 'fwd', 'bwd' or 'both', got {direction!r:.20}")
        if clear_contexts:
            for point in self._points.values():
                point.ctx = {}
        self._attached = [hook for hook in self._attached
                          if (hook.permanent and not including_permanent)
                          or (level is not None and hook.level != level)
                          or direction not in ("both", hook.dir)]

    @contextmanager
    def hooks(self, fwd_hooks: Iterable[tuple[Any, LensHookFn]] = (),
              bwd_hooks: Iterable[tuple[Any, LensHookFn]] = (), reset_hooks_end: bool = True,
              clear_contexts: bool = False) -> Iterator[Any]:
        """Within the block, `fwd_hooks` and `bwd_hooks` are attached to every run; after it they
        are removed (unless reset_hooks_end=False), and the points' ctx emptied with
        `clear_contexts`. A backward hook hangs on each run's graph, so a backward taken after
        the block still reaches the hooks of the runs made inside it."""
        pairs = [(*pair, "fwd") for pair in self._as_glass_pairs(fwd_hooks)]
        pairs += [(*pair, "bwd") for pair in self._as_glass_pairs(bwd_hooks)]  # all checked first
        self._context_level += 1
        level = self._context_level
        self._attached += [AttachedHook(name, fn, False, level, way) for name, fn, way in pairs]
        try:
            yield self
        finally:
            if reset_hooks_end:
                self.reset_hooks(clear_contexts, including_permanent=False, level=level)
            self._context_level -= 1
