"""Int8 weight-only decoding: every product's weight as int8, with one scale per output row.

Decoding a token at batch 1 reads every weight once, so its speed is the bytes it reads
(`decoding.cpu`). Int8 weights are a quarter of float32's bytes and half of bf16's; the
activations stay in the model's float dtype. `quantize_int8(model)` gives a copy of a plain
`GPT` in which
    every nn.Linear          -> `Int8Linear`: its weight W (out, in) as int8 rows q and a scale
                                s (out,), W ~ q * s[:, None] with s = max|row| / 127 (symmetric,
                                llama.cpp's Q8_0 rounding with a scale per row instead of per
                                block of 32: as close to float32 as llama.cpp's Q8_0 arithmetic
                                on the models measured, BENCHMARKS.md)
    a token table tied to    -> `Int8Embedding`, reading the LM head's own int8 table (one table
    the LM head                 both ways, as in the float model)
and everything else (norms, biases, the position table, an untied token table, of which a step
reads one row) as it was. The quantized model is still a plain model: `GPT.forward` runs it and
every engine decodes it, and its logits are those of `dequantized(model)`, the float GPT whose
weights are q * s, to float rounding (the scale is applied to each sum instead of to every
weight).

This per-row form is the library's int8 weight-only model (`quantize_int8`); `sample --dtype
int8` decodes llama.cpp's Q8_0 blocks with integer products instead (glassgpt.decoding.blocks).
A per-row product is fast inside the compiled CPU step, where a lone row is multiplied as a
reduction (`Int8ReductionLinear`, as `decoding.cpu.ReductionLinear` does for float weights) and
each int8 weight is converted inside the loop that streams it: 2.2-2.4x a compiled float32
step on GPT-2. Uncompiled, a product is `_weight_int8pack_mm` (gpt-fast's CPU kernel;
feature-detected) where it is the faster one, bf16 activations and a few rows, and otherwise the
int8 weight converted for one `F.linear(x, q) * s`, slower than float32 (each weight is written
out as a float first).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from glassgpt.errors import ModelError

INT8_MAX = 127  # symmetric: -127..127, so that -q is always representable (as Q8_0)
# `_weight_int8pack_mm` runs a vectorised loop for bf16 activations only (float32 and float16
# take a scalar one, 2-4x slower than float32's own F.linear), and reads the weights once per
# few rows: past 16 rows (a prompt) converting the weight for one BLAS product is faster.
# Measured on this project's hosts, torch 2.13 (BENCHMARKS.md, "int8 weight-only decoding").
INT8_MM_DTYPES = (torch.bfloat16,)
INT8_MM_DEVICES = ("cpu",)  # where torch ships a kernel for it (not CUDA)
INT8_MM_MAX_ROWS = 16


def quantize_rows(weight: Tensor, dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
    """weight (out, in) -> (q (out, in) int8, s (out,) in `dtype`, default the weight's), with
    s = max|row| / 127 and q = round(weight / s), so that |weight - q * s| <= s / 2 everywhere.

    The scale is rounded to `dtype` first and q computed against the rounded scale, so that
    q * s is exactly what the quantized model multiplies by. A row of zeros gets scale 1.
    """
    dtype = dtype or weight.dtype
    w = weight.detach().float()
    absmax = w.abs().amax(dim=1)  # (out,)
    scales = torch.where(absmax > 0, absmax / INT8_MAX, torch.ones_like(absmax)).to(dtype)
    q = torch.round(w / scales.float().unsqueeze(1)).clamp(-INT8_MAX, INT8_MAX)
    return q.to(torch.int8), scales


def dequantize_rows(q: Tensor, scales: Tensor) -> Tensor:
    """q (out, in) int8 and s (out,) -> the float weight q * s[:, None] (out, in), in s's dtype."""
    return q.to(scales.dtype) * scales.unsqueeze(1)


def has_int8_mm(x: Tensor, scales: Tensor) -> bool:
    """Whether `_weight_int8pack_mm` is the faster product for x (..., in) here: the installed
    torch has it (feature-detected), for x's device, dtype and a few rows."""
    return (hasattr(torch.ops.aten, "_weight_int8pack_mm") and x.device.type in INT8_MM_DEVICES
            and x.dtype in INT8_MM_DTYPES and scales.dtype == x.dtype
            and x.numel() <= INT8_MM_MAX_ROWS * x.shape[-1])


def int8_linear(x: Tensor, q: Tensor, scales: Tensor, bias: Tensor | None = None) -> Tensor:
    """x (..., in) times the int8 weight q (out, in) with scales s (out,), plus bias: (..., out).

    Both ways multiply by q and scale the sums, (x . q) * s, never forming q * s.
    """
    if has_int8_mm(x, scales):
        y = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, q.shape[1]), q, scales)
        y = y.view(*x.shape[:-1], q.shape[0])  # (rows, out) -> (..., out)
    else:  # the weight converted for one product: gpt-fast's form, which a compiled step fuses
        y = F.linear(x, q.to(x.dtype)) * scales.to(x.dtype)
    return y if bias is None else y + bias


class Int8Linear(nn.Module):
    """A Linear layer whose weight is int8 rows `qweight` (out, in) with per-row `scales` (out,).

    The int8 tensors are parameters without gradients (not buffers) so that moving the model
    keeps a tied head and token table one tensor, as it keeps the float model's. `weight` is the
    float weight q * s, made afresh at every read for the readers of a plain model's weights
    (the KV cache takes its dtype; glassgpt.interp reads the head): the products never use it.
    """

    def __init__(self, qweight: Tensor | nn.Parameter, scales: Tensor | nn.Parameter,
                 bias: Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = qweight.shape
        self.qweight = _frozen(qweight)
        self.scales = _frozen(scales)
        if bias is not None and not isinstance(bias, nn.Parameter):
            bias = nn.Parameter(bias)
        self.register_parameter("bias", bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int8Linear:
        """The int8 form of `linear`; its bias is kept as it is (a float parameter)."""
        q, scales = quantize_rows(linear.weight)
        return cls(q, scales, linear.bias)

    @property
    def weight(self) -> Tensor:
        return dequantize_rows(self.qweight, self.scales)

    @property
    def float_dtype(self) -> torch.dtype:
        """The dtype of the activations it takes (glassgpt.inputs.float_dtype)."""
        return self.scales.dtype

    def forward(self, x: Tensor) -> Tensor:
        return int8_linear(x, self.qweight, self.scales, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, int8 weight, {self.scales.dtype} scale per row")


class Int8ReductionLinear(Int8Linear):
    """Int8Linear whose lone input row is a multiply-then-sum for the compiled step to fuse
    (`decoding.cpu.ReductionLinear`'s int8 form): each int8 weight is converted inside the
    loop that streams it, and the row's sums are scaled once."""

    def forward(self, x: Tensor) -> Tensor:
        if x.numel() != self.in_features or not torch.compiler.is_compiling():
            return super().forward(x)
        row = x.reshape(1, -1).float()  # (1, in), converted once
        y = (self.qweight * row).sum(dim=-1) * self.scales  # (out, in)*(1, in) -> (out,)
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype).view(*x.shape[:-1], self.out_features)


class Int8Embedding(nn.Module):
    """A token table of int8 rows with a scale per row: the tied LM head's own tensors."""

    def __init__(self, qweight: Tensor | nn.Parameter, scales: Tensor | nn.Parameter):
        super().__init__()
        self.num_embeddings, self.embedding_dim = qweight.shape
        self.qweight = _frozen(qweight)
        self.scales = _frozen(scales)

    @property
    def weight(self) -> Tensor:
        return dequantize_rows(self.qweight, self.scales)

    def forward(self, idx: Tensor) -> Tensor:
        """Token ids (...) -> their rows q * s (..., C), exactly the dequantized table's."""
        rows = F.embedding(idx, self.qweight).to(self.scales.dtype)  # (..., C)
        return rows * self.scales[idx].unsqueeze(-1)


def _frozen(t: Tensor | nn.Parameter) -> nn.Parameter:
    return t if isinstance(t, nn.Parameter) else nn.Parameter(t, requires_grad=False)


def is_quantized(model: nn.Module) -> bool:
    """Whether `model` holds int8 layers (`quantize_int8`'s output)."""
    return any(isinstance(m, Int8Linear | Int8Embedding) for m in model.modules())


def quantize_int8(model: nn.Module) -> nn.Module:
    """An int8 copy of the float GPT `model` (module docstring): every nn.Linear an
    `Int8Linear`, and a token table tied to the LM head an `Int8Embedding` over the head's int8
    table. The copy holds no float weight it quantized (nor shares any tensor with `model`,
    which is left as it was) and is in eval mode. Quantize on the device it will decode on.
    """
    if is_quantized(model):
        raise ModelError("this model is int8 already; quantize its float model")
    targets = [m.weight for m in model.modules() if type(m) is nn.Linear]
    if not targets:
        raise ModelError(f"{type(model).__name__} has no nn.Linear layer to quantize")
    # The weights being quantized are not copied (their modules are replaced below).
    int8 = copy.deepcopy(model, memo={id(w): w for w in targets})
    tied = _tied(int8)
    for parent, name, child in list(_children(int8)):
        if type(child) is nn.Linear:
            setattr(parent, name, Int8Linear.from_linear(child))
    if tied:
        head = int8.lm_head
        int8.tok_emb = Int8Embedding(head.qweight, head.scales)
    return int8.eval()


def dequantized(model: nn.Module) -> nn.Module:
    """The float GPT of int8 `model`: every layer's weight q * s, tied as the int8 model is.
    The reference the int8 model's decoding is held to (its tokens, its logits to rounding)."""
    plain = copy.deepcopy(model)
    tied = isinstance(plain.tok_emb, Int8Embedding)
    for parent, name, child in list(_children(plain)):
        if isinstance(child, Int8Linear):
            linear = nn.Linear(child.in_features, child.out_features, bias=child.bias is not None,
                               device=child.qweight.device, dtype=child.scales.dtype)
            linear.weight = nn.Parameter(child.weight.detach())
            if child.bias is not None:
                linear.bias = child.bias
            setattr(parent, name, linear)
        elif isinstance(child, Int8Embedding):
            setattr(parent, name, nn.Embedding.from_pretrained(child.weight.detach(),
                                                               freeze=False))
    if tied:
        plain.lm_head.weight = plain.tok_emb.weight
    return plain.eval()


def _children(model: nn.Module) -> Iterator[tuple[nn.Module, str, nn.Module]]:
    """(parent, name, child) for every module below `model`, each once."""
    for parent in list(model.modules()):
        for name, child in parent.named_children():
            yield parent, name, child


def _tied(model: nn.Module) -> bool:
    head, table = getattr(model, "lm_head", None), getattr(model, "tok_emb", None)
    return (isinstance(head, nn.Linear) and isinstance(table, nn.Embedding)
            and head.weight is table.weight)
