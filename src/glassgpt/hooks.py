"""Hook points: named, do-nothing modules at the activations a reader asks about.

A hook point returns its input unchanged. It exists so that a cache, a patch or an ablation can
reach inside the model without a new forward argument: `glassgpt.interp` attaches a PyTorch
forward hook to the point, reads the tensor or returns a replacement, and removes the hook again.
Unused, a point is one module call that returns its argument.

The names are TransformerLens's, so that its tutorials carry over: `hook_embed`,
`blocks.0.attn.hook_q` (batch, pos, head, d_head), `blocks.0.attn.hook_pattern`
(batch, head, query, key), `blocks.0.mlp.hook_post`, `ln_final.hook_normalized`, ... A point's
name is its module path, with two of glassgpt's module names spelled as TransformerLens does
(`ffn` -> `mlp`, `ln_f` -> `ln_final`); `GPT` names its points once, when it is built.
"""

from __future__ import annotations

from torch import Tensor, nn

# glassgpt's module name -> TransformerLens's, where they differ (state-dict keys keep ours).
LENS_MODULE_NAMES = {"ffn": "mlp", "ln_f": "ln_final"}


class HookPoint(nn.Module):
    """An activation with a name: identity, unless a hook attached by glassgpt.interp replaces it.
    """

    def __init__(self) -> None:
        super().__init__()
        self.name = ""  # set by name_hook_points once the point's place in the model is known

    def forward(self, x: Tensor) -> Tensor:
        return x

    @property
    def active(self) -> bool:
        """Whether a hook is attached: code that would skip computing this activation (the
        fused attention kernel never forms the pattern) computes it when someone is looking."""
        return bool(self._forward_hooks)

    def extra_repr(self) -> str:
        return self.name


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
