"""int8 and 4-bit decoding with integer dot products (`glassgpt.decoding.blocks`, the kernel
`blockdot.c` built by `glassgpt.decoding.kernels`).

The formats are llama.cpp's, byte for byte (its converter's rounding, `gguf.quants`); the
kernel's sums are the written-out reference's (`reference_matmul`: ggml's Q8_0/Q4_0 dot product
of the same blocks, in its order) bit for bit; a quantized model gives the same tokens through
the kernel and through the reference, and stays close to its float model.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from glassgpt.cli import main
from glassgpt.config import GPTConfig
from glassgpt.decoding import blocks
from glassgpt.decoding.blocks import (
    BlockEmbedding,
    BlockLinear,
    dequantize,
    quantize_activations,
    quantize_blocks,
    quantize_q4_0,
    quantize_q8_0,
    reference_matmul,
    reference_products,
)
from glassgpt.decoding.generate import generate
from glassgpt.decoding.kernels import blockdot, kernel_matmul, kernel_quantize_q8_0
from glassgpt.decoding.prepare import decoding_model
from glassgpt.errors import ModelError
from glassgpt.model import GPT
from glassgpt.rundir.checkpoint import Run

QUANTIZE = {"q8_0": quantize_q8_0, "q4_0": quantize_q4_0}


def kernel():
    """The built kernel. The tests' install needs a C compiler (llama.cpp is built from source
    there), so the kernel must build and load: a machine where it does not fails here, never
    skips (the torch reference's own tests below hold the fallback)."""
    lib = blockdot()
    assert lib is not None, ("the block kernel did not build: no C compiler (cc, gcc or clang, "
                             "or $CC) here, or it failed; see glassgpt.decoding.kernels")
    return lib


def weight_with_ties(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """Random rows, some blocks of which land exactly on the roundings' halfway points."""
    torch.manual_seed(seed)
    w = torch.randn(rows, cols)
    w[0, :32] = torch.arange(32) - 15.5  # d = 16.5/127: x/d = k + 1/2 nowhere, but 8.5 edges
    w[1, :32] = (torch.arange(32) - 16) / 2  # q4_0: d = -1, w/d + 8.5 exactly .5 steps
    w[2, 32:64] = 0.0  # an all-zero block: d = 0
    return w


# --- the formats -----------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["q8_0", "q4_0"])
def test_the_blocks_are_the_bytes_llama_cpps_converter_writes(kind: str) -> None:
    gguf = pytest.importorskip("gguf", reason="the optional extra gguf is the reference")
    w = weight_with_ties(7, 96)
    q, d = QUANTIZE[kind](w)
    theirs = gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType[kind.upper()])
    per_block = theirs.reshape(7, 3, -1)  # (rows, blocks, 2 bytes of d + the values)
    scales = torch.from_numpy(per_block[..., :2].copy())
    assert torch.equal(d.view(torch.uint8).view(7, 3, 2), scales)
    values = torch.from_numpy(per_block[..., 2:].copy()).reshape(7, -1)
    assert torch.equal(q.view(torch.uint8), values)
    back = gguf.quants.dequantize(theirs, gguf.GGMLQuantizationType[kind.upper()])
    assert torch.equal(dequantize(kind, q, d), torch.from_numpy(back))


def test_a_row_off_the_block_size_is_refused_by_name() -> None:
    with pytest.raises(ModelError, match="multiple of 32 long, not 48"):
        quantize_q8_0(torch.randn(4, 48))


# --- the product: the kernel against the written-out reference -------------------------------

def test_the_kernel_rounds_activations_as_ggml_ties_to_even() -> None:
    lib = kernel()
    x = torch.randn(3, 128)
    x[0, :32] = torch.arange(32) - 15.5  # amax 16.5 scales no value to a half
    x[1, :32] = torch.cat([torch.tensor([127.0]), torch.arange(31) + 0.5])  # id 1: x.5 ties
    x[2, 32:64] = 0.0
    q, d = kernel_quantize_q8_0(lib, x)
    rq, rd = quantize_activations(x)
    assert torch.equal(q, rq) and torch.equal(d, rd)
    assert q[1, 1:5].tolist() == [0, 2, 2, 4]  # 0.5, 1.5, 2.5, 3.5: halves to even
    assert d[2, 1] == 0 and (q[2, 32:64] == 0).all()


@pytest.mark.parametrize("kind", ["q8_0", "q4_0"])
# 513 blocks a row: past the vectorised path's 512, the kernel's portable C loop
@pytest.mark.parametrize(("rows", "inp", "out"), [(1, 768, 67), (3, 96, 10), (2, 32, 5),
                                                  (1, 32 * 513, 3)])
def test_the_kernels_sums_are_the_references_bit_for_bit(kind: str, rows: int, inp: int,
                                                          out: int) -> None:
    lib = kernel()
    torch.manual_seed(rows * inp + out)
    w, x, bias = weight_with_ties(out, inp), torch.randn(rows, inp) * 4, torch.randn(out)
    q, d = QUANTIZE[kind](w)
    for b in (None, bias):
        ours = kernel_matmul(lib, kind, x, q, d, b)
        assert torch.equal(ours, reference_matmul(kind, x, q, d, b))
    # ... and both are the product of the dequantized weight and activations, to float rounding
    xq, xd = quantize_activations(x)
    exact = dequantize("q8_0", xq, xd).double() @ dequantize(kind, q, d).double().T
    torch.testing.assert_close(ours.double() - bias.double(), exact, rtol=1e-5, atol=1e-4)


def test_the_reference_is_ggmls_lane_order_written_out() -> None:
    """One block pair by hand: 8 lanes of 4 products, a fused multiply-add per lane and block,
    then ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7))."""
    torch.manual_seed(3)
    w, x = torch.randn(1, 64), torch.randn(1, 64)
    q, d = quantize_q8_0(w)
    xq, xd = quantize_activations(x)
    lanes = [0.0] * 8
    for b in range(2):
        scale = torch.tensor(float(d[0, b]) * float(xd[0, b]), dtype=torch.float32).item()
        for lane in range(8):
            s = sum(int(q[0, 32 * b + j]) * int(xq[0, 32 * b + j])
                    for j in range(4 * lane, 4 * lane + 4))
            lanes[lane] = torch.tensor(s * scale + lanes[lane], dtype=torch.float64).float().item()
    f = [torch.tensor(v, dtype=torch.float32) for v in lanes]
    expected = ((f[0] + f[4]) + (f[2] + f[6])) + ((f[1] + f[5]) + (f[3] + f[7]))
    assert torch.equal(reference_matmul("q8_0", x, q, d)[0, 0], expected)


# --- the model -------------------------------------------------------------------------------

def tiny_gpt(tie: bool = True, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=67, block_size=32, n_layer=2, n_head=2, n_embd=64,
                         tie_weights=tie)).eval()


@pytest.mark.parametrize("kind", ["q8_0", "q4_0"])
@pytest.mark.parametrize("tie", [True, False])
def test_a_block_model_decodes_the_same_tokens_through_kernel_and_reference(kind: str,
                                                                           tie: bool) -> None:
    kernel()
    model = tiny_gpt(tie)
    quantized = quantize_blocks(model, kind)
    assert all(type(m) is not torch.nn.Linear for m in quantized.modules())
    if tie:  # the token table reads the head's own blocks
        assert isinstance(quantized.tok_emb, BlockEmbedding)
        assert quantized.tok_emb.qweight is quantized.lm_head.qweight
    prompt = torch.randint(0, 67, (2, 5), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        fast = quantized(prompt)[0]
        with reference_products():
            slow = quantized(prompt)[0]
    assert torch.equal(fast, slow)
    ours = generate(quantized, prompt, max_new_tokens=12, temperature=0.0, engine="auto")
    with reference_products():
        reference = generate(quantized, prompt, max_new_tokens=12, temperature=0.0,
                             engine="eager")
    assert torch.equal(ours, reference)
    assert isinstance(quantized.lm_head, BlockLinear)
    assert model.lm_head.weight.dtype == torch.float32  # the float model is left as it was


@pytest.mark.parametrize(("kind", "max_kl"), [("q8_0", 2e-3), ("q4_0", 5e-2)])
def test_a_block_model_stays_close_to_its_float_model(kind: str, max_kl: float) -> None:
    model = tiny_gpt()
    idx = torch.randint(0, 67, (4, 32), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        reference, approx = model(idx)[0], quantize_blocks(model, kind)(idx)[0]
    kl = F.kl_div(approx.log_softmax(-1), reference.log_softmax(-1), log_target=True,
                  reduction="none").sum(-1).mean()
    assert 0 < float(kl) < max_kl


def test_quantizing_twice_or_an_unknown_format_is_refused() -> None:
    quantized = quantize_blocks(tiny_gpt(), "q8_0")
    with pytest.raises(ModelError, match="quantized already"):
        quantize_blocks(quantized, "q4_0")
    with pytest.raises(ModelError, match="unknown block format 'q5_0'"):
        quantize_blocks(tiny_gpt(), "q5_0")


def test_int8_and_int4_decode_uncompiled_as_blocks() -> None:
    for dtype, kind in (("int8", "q8_0"), ("int4", "q4_0")):
        ready = decoding_model(tiny_gpt(), dtype)
        assert not ready.compiled and ready.model.lm_head.kind == kind


def test_sample_dtype_int4_decodes_the_runs_q4_0_model(trained_run, capsys) -> None:
    capsys.readouterr()
    args = ["sample", str(trained_run.run), "--dtype", "int4", "--prompt", "To be",
            "--max-new-tokens", "12", "--temperature", "0", "--threads", "1"]
    assert main(args) == 0
    out, err = capsys.readouterr()
    assert "int4: every layer's weight in Q4_0 blocks" in err
    model, tokenizer = Run(trained_run.run).load_model("cpu")
    prompt = torch.tensor([tokenizer.encode("To be")])
    with reference_products():
        expected = generate(quantize_blocks(model, "q4_0"), prompt, max_new_tokens=12,
                            temperature=0.0, engine="eager")
    assert out == tokenizer.decode(expected[0].tolist()) + "\n"


def test_a_gguf_q4_0_file_holds_the_models_blocks(tmp_path: Path) -> None:
    gguf = pytest.importorskip("gguf", reason="GGUF export needs the optional extra gguf")
    from glassgpt.formats.gguf import write_gguf

    model = tiny_gpt()
    exported = write_gguf(model, None, tmp_path / "m.gguf", "q4_0")
    assert exported.dtype == "q4_0" and not exported.notes
    reader = gguf.GGUFReader(tmp_path / "m.gguf")
    tensor = next(t for t in reader.tensors if t.name == "blk.0.ffn_up.weight")
    assert tensor.tensor_type == gguf.GGMLQuantizationType.Q4_0
    q, d = quantize_q4_0(model.blocks[0].ffn.fc.weight)
    rows = torch.from_numpy(tensor.data.copy()).reshape(q.shape[0], -1, 18)  # d, 16 bytes
    assert torch.equal(rows[..., 2:].reshape(q.shape), q)
    assert torch.equal(rows[..., :2].reshape(-1, 2), d.view(torch.uint8).view(-1, 2))


def test_the_module_keeps_one_switch_for_the_reference() -> None:
    assert blocks._use_kernel
    with reference_products():
        assert not blocks._use_kernel
    assert blocks._use_kernel
