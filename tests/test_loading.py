"""Loading a model costs the file's bytes, not a second model: the weights a run or a Hugging
Face directory holds become the model's parameters as they are read (no random initialisation
to overwrite, no copy), and `--dtype bfloat16` reads them straight into bfloat16."""

from __future__ import annotations

import gc
import tracemalloc
from pathlib import Path

import pytest
import torch
from torch import nn

from conftest import tiny_gpt
from glassgpt.rundir.checkpoint import Run, load_model, save_model
from glassgpt.storage import tensorfile
from glassgpt.tokenizers import CharTokenizer

TEXT = "To be or not to be, that is the question."


@pytest.fixture()
def saved_run(tmp_path: Path) -> Path:
    """A tiny run whose embedding is the largest tensor (vocabulary 8,192 x width 32: 1 MiB)."""
    tokenizer = CharTokenizer.from_text(TEXT)
    model = tiny_gpt(vocab_size=8192)
    save_model(tmp_path / "run", model, tokenizer)
    return tmp_path / "run"


@pytest.fixture()
def read_tensors(monkeypatch) -> list[torch.Tensor]:
    """Every tensor SafetensorsFile.read returns, in order."""
    seen: list[torch.Tensor] = []
    read = tensorfile.SafetensorsFile.read

    def recording(self, name, dtype=None):
        tensor = read(self, name, dtype)
        seen.append(tensor)
        return tensor

    monkeypatch.setattr(tensorfile.SafetensorsFile, "read", recording)
    return seen


@pytest.fixture()
def random_inits(monkeypatch) -> list[tuple[int, ...]]:
    """The shape of every real (not meta) tensor that nn.init.normal_ fills."""
    filled: list[tuple[int, ...]] = []
    normal = nn.init.normal_

    def counting(tensor, *args, **kwargs):
        if tensor.device.type != "meta":
            filled.append(tuple(tensor.shape))
        return normal(tensor, *args, **kwargs)

    monkeypatch.setattr(nn.init, "normal_", counting)
    return filled


def load_traced(run_dir: Path, dtype: torch.dtype | None = None) -> tuple[nn.Module, int]:
    """The run's model, and the peak of Python-level allocations while it was loaded (the
    buffers tensors are read into); the tokenizer is read before, outside the count.

    tracemalloc counts every thread's allocations and the first load's lazy imports, so one
    untraced load goes first and the smallest peak of three traced loads is the load's own."""
    run = Run(run_dir)
    run.tokenizer()
    run.load_model(dtype=dtype)
    peaks = []
    for _ in range(3):
        gc.collect()
        tracemalloc.start()
        try:
            model, _ = run.load_model(dtype=dtype)
            peaks.append(tracemalloc.get_traced_memory()[1])
        finally:
            tracemalloc.stop()
    return model, min(peaks)


def test_a_runs_weights_are_the_files_bytes_with_no_random_init(saved_run: Path, read_tensors,
                                                                 random_inits) -> None:
    model, _ = load_model(saved_run)
    assert random_inits == []  # nothing drawn only to be overwritten
    read = {t.data_ptr() for t in read_tensors}
    for name, param in model.named_parameters():
        assert param.data_ptr() in read, f"{name} is a copy of what was read"
    assert model.lm_head.weight is model.tok_emb.weight  # still tied
    assert all(p.requires_grad for p in model.parameters())  # `--init-from` trains these
    assert not any(p.is_meta for p in model.parameters())
    assert model.positions.tolist() == list(range(model.config.block_size))  # buffers made


def test_loaded_weights_compute_what_was_saved(saved_run: Path) -> None:
    torch.manual_seed(0)
    original = tiny_gpt(vocab_size=8192).eval()
    loaded, _ = load_model(saved_run)
    idx = torch.randint(0, 8192, (2, 10))
    assert torch.equal(loaded(idx)[0], original(idx)[0])


def test_bfloat16_loads_as_bfloat16_without_a_float32_copy(saved_run: Path, monkeypatch,
                                                           read_tensors) -> None:
    chunk = 1024
    monkeypatch.setattr(tensorfile, "CONVERT_CHUNK_BYTES", chunk)
    embedding_bytes = 8192 * 32 * 4
    model, peak = load_traced(saved_run, dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert all(t.dtype == torch.bfloat16 for t in read_tensors)
    # The float32 bytes pass through one chunk at a time, never a whole float32 tensor.
    assert peak < embedding_bytes / 2
    full, _ = load_model(saved_run)
    for (name, ours), theirs in zip(model.state_dict().items(), full.state_dict().values(),
                                    strict=True):
        if ours.is_floating_point():
            assert torch.equal(ours, theirs.to(torch.bfloat16)), name


def test_a_float32_load_reads_each_byte_once(saved_run: Path) -> None:
    """Python-level buffers during a float32 load: the file's tensors once, not twice."""
    weights = (saved_run / "model.safetensors").stat().st_size
    model, peak = load_traced(saved_run)
    params = sum(p.numel() for p in model.parameters()) * 4
    assert params <= peak < 1.5 * weights


def test_a_hf_import_builds_no_random_model_and_keeps_bfloat16(tmp_path: Path,
                                                               random_inits) -> None:
    transformers = pytest.importorskip("transformers")
    from glassgpt.formats.interop import from_hf

    config = transformers.Qwen3Config(vocab_size=64, hidden_size=16, intermediate_size=32,
                                      num_hidden_layers=2, num_attention_heads=2,
                                      num_key_value_heads=1, head_dim=8,
                                      max_position_embeddings=16)
    hf_model = transformers.Qwen3ForCausalLM(config).to(torch.bfloat16)
    hf_model.save_pretrained(tmp_path / "hf")
    random_inits.clear()
    model = from_hf(tmp_path / "hf")
    assert random_inits == []
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    idx = torch.randint(0, 64, (1, 8))
    with torch.no_grad():  # float32 compares the weights, not bfloat16's rounding order
        ours, theirs = model.float()(idx)[0], hf_model.float()(idx).logits
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)
    # From a live HF model the weights are copied: the two never share a tensor.
    copied = from_hf(hf_model)
    theirs = {p.data_ptr() for p in hf_model.parameters()}
    assert not any(p.data_ptr() in theirs for p in copied.parameters())
