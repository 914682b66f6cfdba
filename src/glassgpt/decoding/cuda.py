"""Decoding on a CUDA GPU: the one-token step captured once as a CUDA graph, replayed per token.

A GPT-2 step launches a few hundred small kernels; at batch 1 a GPU finishes each long before
the CPU can launch the next, so eager decoding measures Python and launch overhead, not the GPU.
A CUDA graph records the step's kernels once and replays them with one launch. Replaying needs
the same shapes and the same memory every time, so, as in gpt-fast:
  * the KV cache is allocated at full size (`StaticKVCache`), and a step writes its keys and
    values at a position held in a device tensor instead of a Python int;
  * attention runs over the whole cache, with the positions not yet written masked out as
    padding (`pad_mask`, the convention `MultiHeadSelfAttention` already has);
  * the token and the position are copied into fixed input tensors before each replay, and the
    logits come out of a fixed output tensor.
Nothing here reads a value back to the host, so a step costs no synchronisation; sampling stays
on the device too (`glassgpt.decoding.generate`).

`capture=False` runs the same static step without a graph. That is how the tests check, on any
device, that the static step gives exactly the eager tokens.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable
from typing import Any

import torch
from torch import Tensor, nn

from glassgpt.attention import KVCache, MultiHeadSelfAttention
from glassgpt.decoding.engine import EagerEngine, own_code, twin, twin_kind


class StaticKVCache(KVCache):
    """A KVCache that a replayed graph can write: at positions given as a tensor (T,), in
    place, returning the whole buffers (the caller masks the positions not yet written). The
    prefill, at an int, is an ordinary update."""

    def update(self, start_pos: int | Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        if not isinstance(start_pos, Tensor):
            return super().update(start_pos, k, v)
        self.k.index_copy_(2, start_pos, k)  # start_pos (T,): the positions of k, v (B, H, T, d)
        self.v.index_copy_(2, start_pos, v)
        return self.k, self.v


class StaticAttention(MultiHeadSelfAttention):
    """The attention of a static step (the engine's twin of the model's): its positions are a
    device tensor (T,), which a replayed graph reads anew each time, where the plain attention
    takes an int. Its cache's whole buffers are no prefix of the sequence, so a local layer
    hides the keys W or more before the query as padding, never by the band. The prefill
    (eager, at an int) is the plain attention's."""

    def token_positions(self, start_pos: int | Tensor | None, T: int,
                        device: torch.device) -> Tensor:
        if not isinstance(start_pos, Tensor):  # the prefill, or a run without the cache
            return super().token_positions(start_pos, T, device)
        return start_pos

    def read_cache(self, k: Tensor, v: Tensor, pad_mask: Tensor | None,
                   start_pos: int | Tensor, T: int
                   ) -> tuple[Tensor, Tensor, Tensor | None, int | None]:
        if not isinstance(start_pos, Tensor):
            return super().read_cache(k, v, pad_mask, start_pos, T)
        k, v = self.kv_cache.update(start_pos, k, v)  # 2 x (B, H_kv, S, d): the whole buffers
        if self.window is not None:  # one step: the query is at start_pos[-1]
            S = k.shape[2]
            old = (torch.arange(S, device=k.device) <= start_pos[-1] - self.window)  # (S,)
            old = old.expand(k.shape[0], S)
            pad_mask = old if pad_mask is None else pad_mask | old
        return k, v, pad_mask, None


def _static(module: nn.Module) -> type[nn.Module] | None:
    return StaticAttention if type(module) is MultiHeadSelfAttention else None


def static_step(model: Any, token: Tensor, pos: Tensor, key_positions: Tensor) -> Tensor:
    """Logits (B, V) after token (B, 1) at position pos (1,), every shape fixed by the cache.

    key_positions (S,) numbers the cache's slots; those after `pos` hold no key yet and are
    masked out as padding. The stack is `GPT.layers`' loop with the position a device tensor
    (the plain loop takes an int, which a captured graph would keep as a constant).
    """
    unwritten = (key_positions > pos).expand(token.shape[0], -1)  # (B, S)
    x = model.embed(token, pos)  # (B, 1, C)
    extra = model.shortformer_positions(pos, x)  # {} unless positions reach q and k only
    for block in model.blocks:
        x = block(x, pad_mask=unwritten, start_pos=pos, **extra)
    return model.read_out(x)[:, -1]  # (B, 1, V) -> (B, V)


@functools.cache
def compiled_static_step(kind: Hashable) -> Callable[..., Tensor]:
    """`static_step` through torch.compile, built once per process and model kind
    (`twin_kind`), on a code object of its own (`own_code`, as the CPU's compiled step); the
    layer loop is traced into it, which is what `fullgraph` holds it to."""
    step = own_code(static_step)
    return torch.compile(step, fullgraph=True)


class CUDAGraphEngine(EagerEngine):
    """Prefill eagerly; then every step is one replay of a captured CUDA graph.

    `compiled=True` captures the torch.compile'd step instead of the eager one (fewer, fused
    kernels per replay, after a compilation of a minute or so).
    """

    name = "cuda-graph"

    def __init__(self, model: Any, compiled: bool = False, capture: bool = True):
        super().__init__(twin(model, _static))
        self.capture = capture
        self.run: Callable[..., Tensor] = (compiled_static_step(twin_kind(self.model))
                                           if compiled else static_step)
        self.graph: torch.cuda.CUDAGraph | None = None

    def start(self, batch_size: int, max_len: int) -> None:
        c, weight = self.model.config, self.model.lm_head.weight
        for block in self.model.blocks:
            attn = block.attn
            attn.kv_cache = StaticKVCache(batch_size, attn.n_kv_head, c.block_size,
                                          attn.head_dim, dtype=weight.dtype,
                                          device=weight.device)
        # The graph's fixed inputs: the token, its position and the cache slots' positions.
        self.token = torch.zeros(batch_size, 1, dtype=torch.long, device=weight.device)
        self.pos = torch.zeros(1, dtype=torch.long, device=weight.device)
        self.key_positions = torch.arange(c.block_size, device=weight.device)
        if self.capture:
            self._capture()

    def _static_step(self) -> Tensor:
        return self.run(self.model, self.token, self.pos, self.key_positions)

    def _capture(self) -> None:
        """Record one step. Warm-up runs first on a side stream (allocations, library handles,
        compilation), as CUDA graph capture requires; they write only slot 0 of the cache, which
        the prefill overwrites."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), torch.no_grad():
            for _ in range(2):
                self._static_step()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.no_grad(), torch.cuda.graph(self.graph):
            self.logits = self._static_step()

    def step(self, token: Tensor, pos: int) -> Tensor:
        self.token.copy_(token)
        self.pos.fill_(pos)  # a scalar argument of a kernel launch: no host sync
        if self.graph is None:
            return self._static_step()
        self.graph.replay()
        return self.logits.clone()  # the next replay overwrites the output tensor

    def close(self) -> None:
        super().close()
        self.graph = None
