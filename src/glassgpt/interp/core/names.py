"""Hook names read for a run: how far a run must go to form the points it is asked for.

The grammar of a name (`blocks.L.<module>.<point>`, `hook_embed`, `ln_final...`) is
`glassgpt.hooknames.parse_hook_name`'s, below the glass, where `HookPoint.layer()` and the
torch-free settings read it too; this builds TransformerLens's `stop_at_layer` on it.
"""

from __future__ import annotations

from collections.abc import Iterable

from glassgpt.hooknames import parse_hook_name

EMBEDDING_POINTS = ("hook_embed", "hook_pos_embed")  # formed before the first block


def stop_at_layer(names: Iterable[str], n_layer: int) -> int | None:
    """The blocks a run must go through for every one of `names` to be formed, as
    TransformerLens counts them (a point of block L after L + 1 blocks, the embeddings after
    none), at most `n_layer`; None when one lies past the last block (the final norm, the
    logits) or is no point of the grammar's: then the run goes to the end."""
    layers = [0]
    for name in names:
        layer = parse_hook_name(name).layer
        if layer is not None:
            layers.append(layer + 1)
        elif name not in EMBEDDING_POINTS:
            return None
    return min(max(layers), n_layer)
