"""Decoding on a CPU: one-row products spread over every thread, or one compiled step.

Decoding one token at batch 1 multiplies a single row x (1, in) by every weight matrix. That
vector-matrix product reads the whole matrix for two FLOPs per element, so its speed is memory
bandwidth; but CPU BLAS runs an fp32 one on a single thread, which leaves most of the bandwidth
unused (BENCHMARKS.md). Two engines fix that, each on a twin of the model (its weights shared,
their values untouched):

* `CPUEngine` (eager): `ThreadedLinear` splits the output columns into one block per thread and
  multiplies the row by all blocks in one batched matmul, which BLAS spreads over the threads.
* `CompiledCPUEngine`: the whole cached step is one `torch.compile` graph. `ReductionLinear`
  writes a lone row's product as multiply-then-sum, which inductor turns into one vectorised
  loop over the weight's rows, split across the threads and fused with its neighbours, so each
  weight streams through once at close to the memory's read bandwidth; `OneQueryAttention` does
  the same for the single query's attention, so a step is one native function with no
  per-operator Python overhead. (A wide model's step stores every intermediate; its attention
  is two matmuls instead, `OneQueryMatmulAttention`, so the context's products are never
  stored.) An int8 model's products (`decoding.quantized`) fuse the same way,
  `Int8ReductionLinear`: each int8 weight is converted inside the loop that streams it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from glassgpt.attention import MultiHeadSelfAttention, scale_and_cap
from glassgpt.config import SamplingConfig
from glassgpt.decoding.engine import (
    EagerEngine,
    one_token_logits,
    own_code,
    twin,
    twin_kind,
    without_module_guards,
)
from glassgpt.decoding.quantized import Int8Linear, Int8ReductionLinear
from glassgpt.decoding.sampling import greedy_pick, is_greedy

# Inductor options of the compiled step, each applied only where the installed torch knows it
# (`step_compile_options`). By default a CPU kernel may recompute a cheap producer inside its
# consumer; for a LayerNorm feeding a one-row product that means normalising the row again for
# every output feature. A low threshold makes inductor store such a row once (510-575 -> 850-890
# tokens/s on shakespeare-char, BENCHMARKS.md).
CPU_STEP_OPTIONS = {"realize_cpu_opcount_threshold": 10}  # passed only if known to torch
# From this width on, store every intermediate (threshold 0): the norm's scale and shift, still
# recomputed under 10, then cost more per weight element than one more pass per norm. Measured
# side by side in one process (BENCHMARKS.md, "Decoding, third round"): GPT-2 small (768) steps
# 1.33x (fp32) and 1.15x (bf16) faster; shakespeare-char (384) and cpu-small 5-15% slower.
# The wide step's attention is matmuls (`one_query_matmul_attention`); the narrow step keeps
# reductions, 1.25x faster there than matmuls (shakespeare-char, fifth round).
WIDE_FROM = 768
WIDE_CPU_STEP_OPTIONS = {"realize_cpu_opcount_threshold": 0}  # passed only if known, too


class ThreadedLinear(nn.Linear):
    """nn.Linear whose lone input row is multiplied on every thread; any other input (and every
    non-float32 weight: CPU bf16 kernels already use every thread) takes F.linear."""

    def forward(self, x: Tensor) -> Tensor:
        threads = torch.get_num_threads()
        if (x.numel() == self.in_features and self.weight.dtype == torch.float32
                and 1 < threads <= self.out_features):
            return self._one_row(x, threads)
        return F.linear(x, self.weight, self.bias)

    def _one_row(self, x: Tensor, blocks: int) -> Tensor:
        """x (..., in) holding one row -> (..., out): `blocks` column blocks in one bmm.

        The columns that do not fill a whole block (out % blocks of them) get a plain F.linear.
        """
        out_features, in_features = self.weight.shape
        even = out_features - out_features % blocks
        weight, bias = self.weight[:even], None if self.bias is None else self.bias[:even]
        # (even, in) -> (blocks, even/blocks, in) -> (blocks, in, even/blocks): views, no copy.
        w = weight.view(blocks, -1, in_features).transpose(1, 2)
        row = x.reshape(1, 1, in_features).expand(blocks, 1, in_features)  # the row, per block
        y = (torch.bmm(row, w) if bias is None
             else torch.baddbmm(bias.view(blocks, 1, -1), row, w))  # (blocks, 1, even/blocks)
        y = y.view(1, even)  # the blocks side by side
        if even < out_features:
            tail = F.linear(x.reshape(1, in_features), self.weight[even:],
                            None if self.bias is None else self.bias[even:])
            y = torch.cat([y, tail], dim=-1)  # (1, out)
        return y.view(*x.shape[:-1], out_features)


class ReductionLinear(nn.Linear):
    """nn.Linear whose lone input row is a multiply-then-sum, for the compiler to fuse.

    Only inside the compiled step: run eagerly (the prefill's last row into the LM head), the
    product (out, in) would be materialised whole, 154 MB for GPT-2's head in float32."""

    def forward(self, x: Tensor) -> Tensor:
        if x.numel() != self.in_features or not torch.compiler.is_compiling():
            return F.linear(x, self.weight, self.bias)
        # The row in float32, converted once: inductor's loop then converts only the bf16
        # weight, not the row again for every output (1.07-1.20x a GPT-2 bf16 step,
        # BENCHMARKS.md). A product of two bf16 values is exact in float32, so the sums are
        # unchanged; the result is rounded once, after the bias, as F.linear rounds it.
        y = (self.weight * x.reshape(1, -1).float()).sum(dim=-1)  # (out, in)*(1, in) -> (out,)
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype).view(*x.shape[:-1], self.out_features)


Scoring = Callable[[Tensor], Tensor]  # q . k products -> the scores the softmax takes


def plain_scores(products: Tensor, head_dim: int) -> Tensor:
    """The products times 1/sqrt(d): an attention's scores with no scale or cap of its own."""
    return scale_and_cap(products, head_dim, None, None)


def one_query_attention(q: Tensor, k: Tensor, v: Tensor,
                        scored: Scoring | None = None) -> Tensor:
    """softmax(q k^T / sqrt(d)) v for one query position, as reductions a compiler can fuse.

    q (B, H, 1, d), k and v (B, H, S, d) -> (B, H, 1, d). `scored` turns the q . k products
    into scores: the attention's own step (`MultiHeadSelfAttention.scored`: its scale, its
    soft-cap), so a new scoring switch changes the attention, never this step; by default
    1/sqrt(d).
    """
    products = (q * k).sum(dim=-1, keepdim=True)  # (B, H, 1, d) * (B, H, S, d) -> (B, H, S, 1)
    scores = plain_scores(products, q.shape[-1]) if scored is None else scored(products)
    weights = torch.softmax(scores, dim=-2)
    return (weights * v).sum(dim=-2, keepdim=True)  # (B, H, S, d) -> (B, H, 1, d)


def one_query_matmul_attention(q: Tensor, k: Tensor, v: Tensor,
                               scored: Scoring | None = None) -> Tensor:
    """`one_query_attention` as two batched matmuls, the softmax in float32 (or wider) between.

    For the wide step, which stores every intermediate (WIDE_CPU_STEP_OPTIONS): there the
    reductions' products q*k and w*v, (B, H, S, d) each, are written out and read back (in bf16,
    rounded one by one), a cost that grows with the context: GPT-2's step at positions 600-727
    took 1.9x (fp32) and 1.4x (bf16) as long as with these matmuls, which never form them
    (BENCHMARKS.md, "Decoding, fifth round").
    """
    products = q @ k.transpose(-2, -1)  # (B, H, 1, d) @ (B, H, d, S) -> (B, H, 1, S)
    products = products.to(torch.promote_types(products.dtype, torch.float32))  # bf16 -> fp32
    scores = plain_scores(products, q.shape[-1]) if scored is None else scored(products)
    weights = torch.softmax(scores, dim=-1).to(v.dtype)
    return weights @ v  # (B, H, 1, S) @ (B, H, S, d) -> (B, H, 1, d)


class OneQueryAttention(MultiHeadSelfAttention):
    """Attention whose single unmasked query (a decoding step) is `one_query_attention`."""

    one_query = staticmethod(one_query_attention)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, pad_mask: Tensor | None,
               window: int | None = None) -> Tensor:
        # A local layer's step arrives with only its window's keys (`read_cache`).
        in_window = window is None or k.shape[2] <= window
        watched = self.hook_attn_scores.active or self.hook_pattern.active
        if (q.shape[2] == 1 and pad_mask is None and not watched and not self.training
                and self.impl == "fused" and in_window):
            return self.one_query(q, k, v, self.scored)
        return super().attend(q, k, v, pad_mask, window)


class OneQueryMatmulAttention(OneQueryAttention):
    """`OneQueryAttention` whose one query is `one_query_matmul_attention`: the wide step's."""

    one_query = staticmethod(one_query_matmul_attention)


def _threaded(module: nn.Module) -> type[nn.Module] | None:
    return ThreadedLinear if type(module) is nn.Linear else None


def _fusable(module: nn.Module) -> type[nn.Module] | None:
    if type(module) is nn.Linear:
        return ReductionLinear
    if type(module) is Int8Linear:
        return Int8ReductionLinear
    return OneQueryAttention if type(module) is MultiHeadSelfAttention else None


def _fusable_wide(module: nn.Module) -> type[nn.Module] | None:
    if type(module) is MultiHeadSelfAttention:
        return OneQueryMatmulAttention
    return _fusable(module)


class CPUEngine(EagerEngine):
    """Eager decoding with every one-row product spread over the threads. (Weights stay in
    PyTorch's own layout: an input-major copy measured no faster with torch 2.13, BENCHMARKS.md.)
    """

    name = "cpu"

    def __init__(self, model: Any):
        super().__init__(twin(model, _threaded))


class CompiledCPUEngine(EagerEngine):
    """Every cached step is one compiled graph (`compiled_step`), compiled once per process and
    model shape/dtype (seconds to a minute), then 1.5-2.5x faster than eager (BENCHMARKS.md).

    The cache is allocated at full size and the position is a dynamic size, so one compilation
    serves every step and prompt length; attention reads only the filled prefix. (gpt-fast
    instead attends over the whole cache under a mask, which for GPT-2's 1024 positions reads
    more cache than a short sequence needs.)
    """

    name = "cpu-compiled"

    def __init__(self, model: Any):
        wide = is_wide(model.config.n_embd)
        super().__init__(twin(model, _fusable_wide if wide else _fusable))
        options = step_compile_options(options_for_width(model.config.n_embd))
        self.compiled = compiled_step(tuple(sorted(options.items())), twin_kind(self.model))

    def start(self, batch_size: int, max_len: int) -> None:
        """A full-size cache, kept on the twin from call to call: the compiled graph is tied
        to these cache modules (an older torch recompiles for new ones). The positions a
        prompt or step writes are exactly the ones attention then reads, so stale entries
        from an earlier call are never seen."""
        cache = self.model.blocks[0].attn.kv_cache
        if cache is None or cache.k.shape[0] != batch_size:
            self.model.setup_kv_cache(batch_size, self.model.config.block_size)

    def step(self, token: Tensor, pos: int) -> Tensor:
        return self.compiled(self.model, token, pos)

    def pick(self, logits: Tensor, all_finite: Tensor, sampling: SamplingConfig,
             generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
        """A greedy choice is one compiled loop over the logits (finite check, zeroing, argmax:
        about 0.5 ms of eager operators a step on GPT-2's 50,257 logits); sampling is eager."""
        if is_greedy(sampling.temperature):
            return compiled_greedy_pick()(logits, all_finite)
        return super().pick(logits, all_finite, sampling, generator)

    def close(self) -> None:
        pass  # the cache stays with the twin (see `start`); the user's model never had one


def is_wide(n_embd: int) -> bool:
    """Whether a model this wide gets the wide step: every intermediate stored, and attention's
    one query as matmuls (`OneQueryMatmulAttention`)."""
    return n_embd >= WIDE_FROM


def options_for_width(n_embd: int) -> dict[str, Any]:
    """The inductor options the compiled step of a model this wide asks for."""
    return WIDE_CPU_STEP_OPTIONS if is_wide(n_embd) else CPU_STEP_OPTIONS


def step_compile_options(wanted: dict[str, Any] | None = None) -> dict[str, Any]:
    """The options of `wanted` (default CPU_STEP_OPTIONS) that this torch's inductor knows.

    Inductor refuses an option it does not know, and option names come and go between torch
    releases, so asking for one the installed torch lacks would crash compilation.
    """
    wanted = CPU_STEP_OPTIONS if wanted is None else wanted
    known = set(torch._inductor.list_options())
    return {name: value for name, value in wanted.items() if name in known}


@functools.cache
def compiled_step(options: tuple[tuple[str, Any], ...], kind: Hashable
                  ) -> Callable[[Any, Tensor, int], Tensor]:
    """`one_token_logits` through torch.compile with these inductor options, built once per
    process, options and model kind (`twin_kind`), each on a code object of its own
    (`own_code`): every model of one kind, twins made anew included, shares its graphs."""
    step = own_code(one_token_logits)
    return torch.compile(step, dynamic=True, options=without_module_guards(dict(options)))


@functools.cache
def compiled_greedy_pick() -> Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]:
    """`greedy_pick` through torch.compile, built once per process; the vocabulary and batch
    are dynamic sizes, so one graph serves every model."""
    return torch.compile(greedy_pick, dynamic=True)
