"""The grammar of a hook point's name, TransformerLens's, in one place:

    blocks.L.<module>.<point>   inside block L: `blocks.3.attn.hook_z` (module "attn"),
                                `blocks.3.ln2.hook_normalized` ("ln2"), `blocks.3.hook_resid_pre`
                                (the block's own stream: module "")
    hook_embed, hook_pos_embed  before the blocks
    ln_final.hook_normalized    after them

A dictionary's points extend a model point's name (`blocks.1.hook_resid_post.hook_sae_acts_post`:
module "hook_resid_post"). Torch-free, below the glass: `HookPoint.layer()` reads a name with it,
and so does a setting checked before any model is built (a transcoder's default output point).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HookName:
    """A hook point's name, read: `blocks.3.attn.hook_z` -> HookName(3, "attn", "hook_z")."""

    layer: int | None  # the block the point is in; None before or after the blocks
    module: str  # the parts between the block (or the start) and the point; "" for none
    point: str  # the last part, the point itself


def parse_hook_name(name: str) -> HookName:
    """Read `name` by the grammar above. A name outside the blocks (or no hook name at all)
    reads with layer None; which names a model has is the model's to say, not the grammar's."""
    parts = name.split(".")
    if len(parts) >= 3 and parts[0] == "blocks" and parts[1].isascii() and parts[1].isdigit():
        return HookName(int(parts[1]), ".".join(parts[2:-1]), parts[-1])
    return HookName(None, ".".join(parts[:-1]), parts[-1])
