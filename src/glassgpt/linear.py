"""`Linear`: `nn.Linear`, plus a multi-threaded path for the one-row products of decoding.

Decoding one token at batch 1 multiplies a single row x (1, in) by every weight matrix. That
vector-matrix product reads the whole matrix for two FLOPs per element, so its speed is memory
bandwidth; but CPU BLAS runs an fp32 one on a single thread, which leaves much of the bandwidth
unused (BENCHMARKS.md). `Linear` splits the output columns into one equal block per thread and
multiplies the row by all blocks in one batched matmul, which BLAS spreads over the threads. The
blocks are views of the weight in either memory layout (see `GPT.input_major_weights`).

Under `torch.compile` (the compiled decoding step, `generate(..., compiled=True)`) a lone row is
instead written as multiply-then-sum over the input axis. Inductor turns that reduction into one
vectorised loop over the weight's rows, split across the threads and fused with what comes before
and after it, so the weight streams through once at close to the memory's read bandwidth; a BLAS
call would stay outside the fused graph. Every other input takes the plain `F.linear` path;
weights, names and state dicts are exactly those of `nn.Linear`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class Linear(nn.Linear):
    """y = x W^T + b, exactly `nn.Linear`; a lone input row gets a bandwidth-bound path."""

    def forward(self, x: Tensor) -> Tensor:
        out_features, in_features = self.weight.shape
        if torch.compiler.is_compiling():  # thread counts are not traceable: decide here
            if x.numel() == in_features:
                return self._one_row_reduction(x)
            return F.linear(x, self.weight, self.bias)
        threads = torch.get_num_threads()
        # bf16 kernels already use every thread, and measured slower when split (BENCHMARKS.md).
        if (x.numel() == in_features and self.weight.dtype == torch.float32
                and 1 < threads <= out_features):
            return self._one_row(x, threads)
        return F.linear(x, self.weight, self.bias)

    def _one_row(self, x: Tensor, blocks: int) -> Tensor:
        """x (..., in) holding one row -> (..., out): `blocks` column blocks in one bmm.

        The columns that do not fill a whole block (out % blocks of them) get a plain F.linear.
        """
        out_features, in_features = self.weight.shape
        even = out_features - out_features % blocks
        weight, bias = self.weight, self.bias
        if even < out_features:
            weight, bias = weight[:even], None if bias is None else bias[:even]
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

    def _one_row_reduction(self, x: Tensor) -> Tensor:
        """x (..., in) holding one row -> (..., out) as a reduction, for the compiler to fuse.

        Reads the weight along its rows, so it wants the default (out, in) layout.
        """
        y = (self.weight * x.reshape(1, -1)).sum(dim=-1)  # (out, in) * (1, in) -> (out,)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)
