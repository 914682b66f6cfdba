"""int8 and 4-bit decoding with integer dot products: llama.cpp's Q8_0 and Q4_0 blocks.

A weight row is cut into blocks of 32 values, each stored with one fp16 scale d:
    Q8_0  32 int8 q, w = q * d, d = max|block| / 127        (34 bytes a block: 8.5 bits a weight)
    Q4_0  32 4-bit u, w = (u - 8) * d, d = (the block's value of largest magnitude) / -8
                                                            (18 bytes a block: 4.5 bits a weight)
rounded exactly as llama.cpp's converter rounds them (`gguf.quants`, tests/test_blocks.py), so
a `convert --to-gguf --dtype q8_0/q4_0` file holds the same bytes. A product quantizes its
activation row once, to Q8_0 blocks as llama.cpp does, and multiplies integers by integers:
    y[n] = sum over blocks b of d_w[n, b] * d_x[b] * (q_w[n, b] . q_x[b])
in the order of ggml's vec_dot (`reference_matmul` writes it out: 8 exact int32 lanes of 4
products a block, one fused multiply-add per lane and block, a fixed sum of the lanes).

`blockdot.c` computes it with AVX512-VNNI (glassgpt.decoding.kernels builds it on first use);
`reference_matmul`, in torch, is the same sums bit for bit, and is the path where the kernel is
not available (no C compiler) or not wanted (`reference_products()`). Unlike the int8 rows of
glassgpt.decoding.quantized (float activations), the activations here are rounded too: the
model is held to its own reference path's tokens, and to the float model by top-1 agreement
and KL (BENCHMARKS.md), as llama.cpp's Q8_0 and Q4_0 are.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from glassgpt.decoding.kernels import blockdot, kernel_matmul
from glassgpt.errors import ModelError

QK = 32  # values a block
LANES = 8  # int32 lanes a block's dot product is summed in (ggml's AVX2 order)
KINDS = ("q8_0", "q4_0")
_REFERENCE_ROWS = 4096  # weight rows the reference multiplies at a time (bounds its memory)
_use_kernel = True


# --- the formats -----------------------------------------------------------------------------

def _blocks(weight: Tensor) -> Tensor:
    out, inp = weight.shape
    if inp % QK:
        raise ModelError(f"a block weight's rows must be a multiple of {QK} long, not {inp}")
    return weight.detach().float().reshape(out, inp // QK, QK)  # (N, K) -> (N, B, 32)


def quantize_q8_0(weight: Tensor) -> tuple[Tensor, Tensor]:
    """weight (N, K) -> q (N, K) int8 and d (N, K/32) float16, as ggml's quantize_row_q8_0_ref:
    d = max|block| / 127, q = round-half-away(w / d), the fp16 d stored."""
    blocks = _blocks(weight)
    d = blocks.abs().amax(dim=-1) / 127  # (N, B)
    inverse = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    scaled = blocks * inverse.unsqueeze(-1)
    q = torch.sign(scaled) * torch.floor(scaled.abs() + 0.5)  # C's roundf
    return q.to(torch.int8).reshape(weight.shape), d.half()


def quantize_q4_0(weight: Tensor) -> tuple[Tensor, Tensor]:
    """weight (N, K) -> packed (N, K/2) uint8 and d (N, K/32) float16, as ggml's
    quantize_row_q4_0_ref: d = (value of largest magnitude) / -8, u = min(15, trunc(w/d + 8.5));
    byte j of a block holds u[j] in its low nibble and u[j + 16] in its high one."""
    blocks = _blocks(weight)
    largest = blocks.gather(-1, blocks.abs().argmax(dim=-1, keepdim=True))  # (N, B, 1)
    d = largest / -8
    inverse = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    u = torch.trunc(blocks * inverse + 8.5).clamp(0, 15).to(torch.uint8)  # (N, B, 32)
    packed = u[..., :16] | (u[..., 16:] << 4)  # (N, B, 16)
    return packed.reshape(weight.shape[0], -1), d.squeeze(-1).half()


def signed_values(kind: str, q: Tensor) -> Tensor:
    """A block weight's integers (N, K) int8: q itself (Q8_0), or each nibble less 8 (Q4_0)."""
    if kind == "q8_0":
        return q
    packed = q.view(q.shape[0], -1, QK // 2)  # (N, B, 16)
    low, high = (packed & 15).to(torch.int8), (packed >> 4).to(torch.int8)
    return (torch.cat([low, high], dim=-1) - 8).reshape(q.shape[0], -1)  # (N, K)


def dequantize(kind: str, q: Tensor, d: Tensor) -> Tensor:
    """The float32 weight (N, K) a block weight stands for: its integers times their block's d."""
    values = signed_values(kind, q).float()
    return (values.view(d.shape[0], -1, QK) * d.float().unsqueeze(-1)).reshape(values.shape)


def quantize_activations(x: Tensor) -> tuple[Tensor, Tensor]:
    """x (M, K) float32 -> q (M, K) int8 and d (M, K/32) float16, as ggml's x86 quantize_row_q8_0:
    d = max|block| / 127, q = round-to-nearest-even(x * (127 / max|block|))."""
    blocks = x.float().reshape(x.shape[0], -1, QK)
    amax = blocks.abs().amax(dim=-1)  # (M, B)
    inverse = torch.where(amax == 0, torch.zeros_like(amax), 127 / amax)
    q = torch.round(blocks * inverse.unsqueeze(-1))  # torch.round: half to even
    return q.to(torch.int8).reshape(x.shape), (amax / 127).half()


# --- the product -----------------------------------------------------------------------------

def reference_matmul(kind: str, x: Tensor, q: Tensor, d: Tensor,
                     bias: Tensor | None = None) -> Tensor:
    """x (M, K) times the block weight (q, d) of `kind`, plus bias: (M, N) float32, the kernel's
    sums bit for bit, written out in torch (module docstring)."""
    xq, xd = quantize_activations(x)
    step = _REFERENCE_ROWS
    rows = [_reference_rows(xq, xd, signed_values(kind, q[i:i + step]), d[i:i + step])
            for i in range(0, q.shape[0], step)]
    y = torch.cat(rows, dim=1)
    return y if bias is None else y + bias.float()


def _reference_rows(xq: Tensor, xd: Tensor, wq: Tensor, wd: Tensor) -> Tensor:
    m, n, blocks = xq.shape[0], wq.shape[0], wd.shape[1]
    # Each lane's 4 products summed exactly (integers below 2^24 are exact in float32).
    x4 = xq.float().view(m, 1, blocks, LANES, 4)
    w4 = wq.float().view(1, n, blocks, LANES, 4)
    lanes = (x4 * w4).sum(dim=-1)  # (M, N, B, 8)
    scales = wd.float().unsqueeze(0) * xd.float().unsqueeze(1)  # (M, N, B), rounded to float32
    acc = torch.zeros(m, n, LANES)
    for b in range(blocks):  # fma(lane, scale, acc): one rounding, from an exact float64 sum
        exact = lanes[:, :, b].double() * scales[:, :, b, None].double() + acc.double()
        acc = exact.float()
    halves = acc[..., :4] + acc[..., 4:]  # (l0+l4, l1+l5, l2+l6, l3+l7)
    return (halves[..., 0] + halves[..., 2]) + (halves[..., 1] + halves[..., 3])


@contextlib.contextmanager
def reference_products() -> Iterator[None]:
    """Within, every block product takes `reference_matmul` instead of the kernel."""
    global _use_kernel
    before, _use_kernel = _use_kernel, False
    try:
        yield
    finally:
        _use_kernel = before


def block_matmul(kind: str, x: Tensor, q: Tensor, d: Tensor, bias: Tensor | None = None
                 ) -> Tensor:
    """x (..., K) times the block weight (q, d), plus bias: (..., N) in x's dtype, through the
    kernel on a CPU where it is built, else `reference_matmul` (the same sums)."""
    rows = x.reshape(-1, x.shape[-1]).float().contiguous()  # (M, K)
    on_cpu = _use_kernel and x.device.type == "cpu"
    if on_cpu and torch.compiler.is_compiling():  # one opaque operator in the compiled step
        y = torch.ops.glassgpt.block_matmul(kind, rows, q, d, bias)
    elif on_cpu and blockdot() is not None:  # the ctypes call itself: no dispatcher between
        y = kernel_matmul(blockdot(), kind, rows, q, d, None if bias is None else bias.float())
    else:
        y = reference_matmul(kind, rows, q, d, bias)
    return y.to(x.dtype).view(*x.shape[:-1], d.shape[0])


@torch.library.custom_op("glassgpt::block_matmul", mutates_args=())
def _block_matmul_op(kind: str, x: Tensor, q: Tensor, d: Tensor, bias: Tensor | None
                     ) -> Tensor:
    """The kernel as a torch operator, so that `--compile` keeps it whole in its graph (the
    reference where the kernel is not built)."""
    lib = blockdot()
    if lib is None:
        return reference_matmul(kind, x, q, d, bias)
    return kernel_matmul(lib, kind, x, q, d, None if bias is None else bias.float().contiguous())


@_block_matmul_op.register_fake
def _(kind: str, x: Tensor, q: Tensor, d: Tensor, bias: Tensor | None) -> Tensor:
    return x.new_empty(x.shape[0], d.shape[0])


# --- the layers and the model ----------------------------------------------------------------

class BlockLinear(nn.Module):
    """A Linear layer whose weight is Q8_0 or Q4_0 blocks (`qweight`, `scales` (N, K/32) fp16),
    multiplied with integer dot products (`block_matmul`). The block tensors are parameters
    without gradients, so that a tied head and token table stay one tensor when moved; `weight`
    is the float weight they stand for, made at each read (for a reader that wants the matrix:
    no step reads it; the stream's checks and the KV cache read `float_dtype`)."""

    def __init__(self, kind: str, qweight: Tensor, scales: Tensor, bias: Tensor | None = None):
        super().__init__()
        self.kind = kind
        self.out_features, self.in_features = scales.shape[0], scales.shape[1] * QK
        self.qweight = _frozen(qweight)
        self.scales = _frozen(scales)
        if bias is not None and not isinstance(bias, nn.Parameter):
            bias = nn.Parameter(bias)
        self.register_parameter("bias", bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear, kind: str) -> BlockLinear:
        q, d = (quantize_q8_0 if kind == "q8_0" else quantize_q4_0)(linear.weight)
        return cls(kind, q, d, linear.bias)

    @property
    def weight(self) -> Tensor:
        return dequantize(self.kind, self.qweight, self.scales)

    float_dtype = torch.float32  # its activations' (glassgpt.inputs.float_dtype): no dequantizing

    def forward(self, x: Tensor) -> Tensor:
        return block_matmul(self.kind, x, self.qweight, self.scales, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, {self.kind} blocks of {QK}")


class BlockEmbedding(nn.Module):
    """A token table read from the tied LM head's blocks: each row dequantized (q * d)."""

    def __init__(self, head: BlockLinear):
        super().__init__()
        self.kind = head.kind
        self.num_embeddings, self.embedding_dim = head.out_features, head.in_features
        self.qweight, self.scales = head.qweight, head.scales

    @property
    def weight(self) -> Tensor:
        return dequantize(self.kind, self.qweight, self.scales)

    def forward(self, idx: Tensor) -> Tensor:
        """Token ids (...) -> their dequantized rows (..., C), float32."""
        flat = idx.reshape(-1)
        rows = dequantize(self.kind, self.qweight[flat], self.scales[flat])  # (n, C)
        return rows.view(*idx.shape, self.embedding_dim)


def _frozen(t: Tensor) -> nn.Parameter:
    return t if isinstance(t, nn.Parameter) else nn.Parameter(t, requires_grad=False)


def has_blocks(model: nn.Module) -> bool:
    """Whether `model` holds block layers (`quantize_blocks`'s output)."""
    return any(isinstance(m, BlockLinear | BlockEmbedding) for m in model.modules())


def quantize_blocks(model: nn.Module, kind: str = "q8_0") -> nn.Module:
    """A copy of the float GPT `model` whose every nn.Linear with rows a multiple of 32 long is
    a `BlockLinear` of `kind` ("q8_0" or "q4_0"), and whose token table, if tied to the LM head,
    reads the head's blocks. Other tensors (norms, biases, positions, an untied table) stay as
    they were; `model` is left as it was. The copy is in eval mode."""
    if kind not in KINDS:
        raise ModelError(f"unknown block format {kind!r}; choose one of {', '.join(KINDS)}")
    if has_blocks(model):
        raise ModelError("this model is quantized already; quantize its float model")
    targets = [m for m in model.modules() if type(m) is nn.Linear and m.in_features % QK == 0]
    if not targets:
        raise ModelError(f"{type(model).__name__} has no nn.Linear whose rows are a multiple "
                         f"of {QK} long")
    weights = [m.weight for m in targets]
    tied = _tied(model)
    quantized = copy.deepcopy(model, memo={id(w): w for w in weights})
    for parent in list(quantized.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and child.in_features % QK == 0:
                setattr(parent, name, BlockLinear.from_linear(child, kind))
    if tied and isinstance(quantized.lm_head, BlockLinear):
        quantized.tok_emb = BlockEmbedding(quantized.lm_head)
    return quantized.eval()


def _tied(model: nn.Module) -> bool:
    head, table = getattr(model, "lm_head", None), getattr(model, "tok_emb", None)
    return (isinstance(head, nn.Linear) and isinstance(table, nn.Embedding)
            and head.weight is table.weight)


def linear_reference(x: Tensor, layer: BlockLinear) -> Tensor:
    """x times the layer's dequantized float weight (no activation rounding): F.linear's
    answer, against which a test bounds what rounding the activations costs."""
    return F.linear(x.float(), layer.weight, None if layer.bias is None else layer.bias.float())
