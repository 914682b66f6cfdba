"""Which Hugging Face tensors make each glassgpt tensor, and how: `weight_mappings` reads an
architecture's name table (glassgpt.formats.architectures) against the tensors a glassgpt model of
a config stores. Every glassgpt tensor is one HF tensor, transposed where GPT-2 stores a Conv1D
(in, out) matrix, its rows regrouped where GPT-NeoX's fused query_key_value holds each head's
q, k, v in turn, or three HF tensors stacked along its rows (Llama's q_proj, k_proj, v_proj
make our `qkv`: [Q, K, V]). glassgpt.formats.interop moves the weights by these mappings.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from glassgpt.config import GPTConfig
from glassgpt.errors import ConfigError
from glassgpt.formats.architectures import GPT2
from glassgpt.formats.translation import Architecture
from glassgpt.rundir.weights import expected_shapes


@dataclass(frozen=True)
class WeightMapping:
    """One glassgpt tensor and the HF tensor(s) it is made of."""

    ours: str
    theirs: tuple[str, ...]  # one HF tensor, or the parts stacked along our rows (q, k, v)
    rows: tuple[int, ...]  # how many of our rows each part holds
    conv1d: bool  # the one HF tensor is stored (in, out): transposed on the way
    per_head: int = 0  # the one HF tensor holds each of this many heads' q, k, v rows in turn

    def their_shapes(self, ours: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
        if self.conv1d:
            return {self.theirs[0]: ours[::-1]}
        return {name: (rows, *ours[1:]) for name, rows in zip(self.theirs, self.rows,
                                                                 strict=True)}

    def ours_from(self, parts: list[Tensor]) -> Tensor:
        """Our tensor, made of the HF tensors `theirs` names (in that order)."""
        if self.conv1d:
            return parts[0].t().contiguous()
        if self.per_head:
            return _swap_row_groups(parts[0], self.per_head, 3)  # (H, 3, d) -> (3, H, d)
        return torch.cat(parts) if len(parts) > 1 else parts[0]  # (H*d + 2*Hkv*d, C)

    def theirs_from(self, ours: Tensor) -> list[Tensor]:
        """The HF tensors `theirs` names, made of our tensor (`ours_from` undone)."""
        if self.conv1d:
            return [ours.t()]
        if self.per_head:
            return [_swap_row_groups(ours, 3, self.per_head)]  # (3, H, d) -> (H, 3, d)
        return list(ours.split(list(self.rows)))  # rows: [Q, K, V]


def _swap_row_groups(qkv: Tensor, outer: int, inner: int) -> Tensor:
    """`qkv`'s rows read as outer x inner blocks of d rows, written inner x outer: GPT-NeoX's
    [head 0's q, k, v, head 1's q, k, v, ...] and our [every head's q, every k, every v] are the
    same rows in two orders. A weight (rows, C) or a bias (rows,)."""
    blocks = qkv.reshape(outer, inner, -1, *qkv.shape[1:])  # (outer, inner, d, ...)
    return blocks.transpose(0, 1).reshape(qkv.shape)  # (inner, outer, d, ...) -> (3*H*d, ...)


def weight_mappings(arch: Architecture, config: GPTConfig) -> list[WeightMapping]:
    """Every tensor a glassgpt model of `config` stores (a tied head once), with its HF names.

    Built from the model's own names (on the meta device: nothing is allocated), so a switch
    that adds or removes a tensor (biases, QK-norm, an untied head) is mapped by construction.
    """
    mappings = []
    for ours, shape in expected_shapes(config).items():
        pattern, layer = _layer_pattern(ours)
        theirs = arch.names.get(pattern)
        if theirs is None:
            raise ConfigError(f"{ours} has no counterpart in a {arch.title} model")
        parts = (theirs,) if isinstance(theirs, str) else theirs
        rows = _qkv_rows(config) if len(parts) == 3 else (shape[0],)
        per_head = config.n_head if pattern in arch.per_head_qkv else 0
        mappings.append(WeightMapping(ours, tuple(p.format(i=layer) for p in parts), rows,
                                      pattern in arch.conv1d, per_head))
    return mappings


def _layer_pattern(name: str) -> tuple[str, str]:
    """"blocks.3.attn.qkv.weight" -> ("blocks.{i}.attn.qkv.weight", "3")."""
    head, _, rest = name.partition(".")
    if head == "blocks":
        layer, _, rest = rest.partition(".")
        return f"blocks.{{i}}.{rest}", layer
    return name, ""


def _qkv_rows(config: GPTConfig) -> tuple[int, int, int]:
    """Rows of Q, K and V in our stacked qkv: n_head heads of queries, n_kv_head of keys and
    of values, each head_dim wide."""
    kv_rows = (config.n_kv_head or config.n_head) * config.head_dim
    return config.n_head * config.head_dim, kv_rows, kv_rows


def weight_names(n_layer: int, tie_weights: bool) -> Iterator[tuple[str, str, bool]]:
    """Every (glassgpt name, HF name, is_conv1d) of a GPT-2 with biases, the layout GPT-2's
    checkpoints have. A tied head has no weight of its own: `lm_head.weight` only when untied.
    """
    config = GPTConfig(n_layer=n_layer, tie_weights=tie_weights)  # names only: sizes unused
    for mapping in weight_mappings(GPT2, config):
        yield mapping.ours, mapping.theirs[0], mapping.conv1d
