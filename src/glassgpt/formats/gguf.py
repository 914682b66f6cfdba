"""GGUF export: a run as the one file llama.cpp runs (`glassgpt convert RUN --to-gguf OUT.gguf`).

    exported = export_gguf("runs/mine", "mine.gguf", dtype="q8_0")  # a run directory
    exported = write_gguf(model, tokenizer, "bench.gguf", "f32")     # a model in memory

The file is written with the `gguf` package, the format's own writer (the optional extra
`gguf`), in llama.cpp's names. The architecture is the one `convert --to-hf` would export
(glassgpt.formats.architectures' `family_choice`), and its record says how it is written
(`Architecture.gguf`, a `GGUFArchitecture`: llama.cpp's name for it, its tensors' names in the
file's order, its settings' keys, where llama.cpp computes less); here nothing asks which
family it is. Four families have one, those llama.cpp computes as glassgpt does:
  * gpt2: learned positions, LayerNorm, GPT-2's tanh GELU; our `qkv` goes whole (attn_qkv).
  * llama (Llama, SmolLM2), qwen2 (biases on q, k and v alone), qwen3 (QK-norm): RMSNorm,
    SwiGLU and rotary; q, k and v as three tensors. llama.cpp's `llama` rotates pairs of
    adjacent features (its NORM rotary) where glassgpt rotates i with i + d/2 (rotate-half, as
    transformers does), so each head's q and k rows (weights and biases) are reordered to put
    every pair side by side: q.k is unchanged, the same reordering on both. `qwen2` and `qwen3`
    rotate halves (NEOX) and take the rows as they are.
Every other switch is refused by name before anything is written (Gemma, GPT-NeoX, post norms,
windows, soft caps, NoPE layers, a GELU other than GPT-2's, ...).

Types: 2-D weights in `dtype` (f32, f16, bf16, q8_0 or q4_0); norms, biases, the rotary factors
and GPT-2's position table stay f32 whatever is asked, as llama.cpp's own converter keeps them.
A q8_0 or q4_0 matrix whose rows are not a multiple of 32 long is written f16 (the converter's
fallback; `GGUFExport.notes` says which).

The vocabulary (`tokenizer.ggml.*`) is glassgpt.formats.gguf_vocab's: a byte-level BPE tokenizer as
llama.cpp's "gpt2" vocabulary with the pre-tokenizer name of its split, a character-level one as
its "rwkv" vocabulary (one token per character, no end-of-text), none as placeholder tokens.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor

from glassgpt.config import GGUF_DTYPES, GPTConfig
from glassgpt.errors import CheckpointError, ConfigError
from glassgpt.formats.architectures import ARCHITECTURES, family_choice
from glassgpt.formats.convert import check_apart
from glassgpt.formats.files import MissingExtraError
from glassgpt.formats.gguf_vocab import add_vocabulary, gguf_vocabulary
from glassgpt.formats.interop import family_settings
from glassgpt.formats.translation import GGUFArchitecture
from glassgpt.machine.distributed import unwrap_model
from glassgpt.rotary import RopeScaling, rotary_frequencies
from glassgpt.rundir.checkpoint import Run
from glassgpt.rundir.weights import expected_shapes
from glassgpt.storage import files
from glassgpt.storage.outputs import check_output_file

if TYPE_CHECKING:
    from glassgpt.model import GPT
    from glassgpt.tokenizers import Tokenizer
    from glassgpt.tokenizers.chat import ChatTemplate

GGUF_INSTALL_HINT = "pip install 'glassgpt[gguf]'"
DTYPES = GGUF_DTYPES


@dataclass(frozen=True)
class GGUFExport:
    """What `write_gguf` / `export_gguf` wrote: the file, llama.cpp's architecture, the type
    of its matrices, how many tensors, its size, the vocabulary (in words) and notes worth
    telling; `weights` says which of a run's weights (`export_gguf` only)."""

    out: Path
    architecture: str
    dtype: str
    tensors: int
    bytes: int
    vocabulary: str
    notes: tuple[str, ...] = ()
    weights: str | None = None


def check_replacing_gguf(out: Path) -> None:
    """`--force` replaces a whole GGUF file (an earlier export), never a file of another kind:
    a notes file that starts with "GGUF" or a copy cut short is kept, with the reason."""
    if not out.is_file():
        return
    why_not = _why_not_gguf(out)
    if why_not is not None:
        raise CheckpointError(f"{out} is there and is not a GGUF file; --force replaces only "
                              f"a GGUF file ({why_not}): give another name")


def _why_not_gguf(path: Path) -> str | None:
    """None when `path` parses as GGUF with gguf's own reader and holds every byte its tensors
    need, else what is wrong with it, in words."""
    with path.open("rb") as file:
        if file.read(4) != b"GGUF":
            return "it does not start with GGUF's magic bytes"
    size = path.stat().st_size
    try:
        reader = _gguf().GGUFReader(path)  # memory-mapped: the tensors are not read
        end = max((tensor.data_offset + tensor.n_bytes for tensor in reader.tensors),
                  default=reader.data_offset)
    except Exception as error:  # a damaged file fails in many ways; each means "not GGUF"
        words = " ".join(str(error).split())[:80] or type(error).__name__
        return f"gguf's reader cannot parse it: {words}"
    if end > size:  # the reader's own checks catch this today; the promise is ours
        return f"it is cut short: its tensors end at byte {end}, the file at {size}"
    return None


def export_gguf(run_dir: str | os.PathLike[str], out: str | os.PathLike[str],
                checkpoint: str = "best", dtype: str = "f32", force: bool = False
                ) -> GGUFExport:
    """A GGUF file at `out` of the run's `checkpoint` weights ("best" or "last"; a LoRA adapter
    merged in), with its tokenizer and chat template, matrices in `dtype`. `out` must be new
    unless `force`, and outside the run. Everything is checked before anything is written."""
    check_dtype(dtype)
    _gguf()
    run_dir, out = Path(run_dir).expanduser(), Path(out).expanduser()
    check_output_file(out, force, CheckpointError)
    check_replacing_gguf(out)
    check_apart(out, run_dir, f"{run_dir}, the run being exported")
    run = Run(run_dir)
    chat = run.chat_template()
    # A refusal of the architecture or the vocabulary costs no reading of the weights.
    gguf_architecture(run.model_config)
    gguf_vocabulary(run.tokenizer(), run.model_config.vocab_size, chat)
    model, tokenizer = run.load_model(checkpoint=checkpoint)
    exported = write_gguf(model, tokenizer, out, dtype, chat=chat, name=run_dir.resolve().name)
    return dataclasses.replace(exported, weights=run.describe_weights(checkpoint))


def write_gguf(model: GPT, tokenizer: Tokenizer | None, out: str | os.PathLike[str],
               dtype: str = "f32", chat: ChatTemplate | None = None,
               name: str = "glassgpt") -> GGUFExport:
    """`model` (its weights as they are, on any device or dtype) as a GGUF file at `out`,
    replacing one there, with `tokenizer`'s vocabulary (None: placeholder tokens, see the
    module's notes) and `chat`'s template. The file appears whole or not at all."""
    check_dtype(dtype)
    gguf = _gguf()
    out = check_output_file(Path(out).expanduser(), True, CheckpointError)
    model = unwrap_model(model)
    config: GPTConfig = model.config
    layout = gguf_architecture(config)
    vocabulary = gguf_vocabulary(tokenizer, config.vocab_size, chat)
    written, notes = _typed(gguf, _tensors(model, layout), dtype)
    try:
        with files.atomic_path(out) as temp:  # a full disk leaves no half file, `out` as it was
            writer = gguf.GGUFWriter(temp, layout.name)
            try:
                _add_settings(writer, gguf, config, layout, dtype, name)
                add_vocabulary(writer, vocabulary)
                for tensor_name, (data, qtype) in written.items():
                    writer.add_tensor(tensor_name, data, raw_dtype=qtype)
                writer.write_header_to_file()
                writer.write_kv_data_to_file()
                writer.write_tensors_to_file()
            finally:
                writer.close()
    except OSError as error:
        raise CheckpointError(f"cannot write {out}: {error.strerror or error}") from None
    return GGUFExport(out, layout.name, dtype, len(written), out.stat().st_size,
                      vocabulary.summary, tuple(notes))


def check_dtype(dtype: str) -> None:
    if dtype not in DTYPES:
        raise ConfigError(f"unknown GGUF dtype {dtype!r}; choose one of {', '.join(DTYPES)}")


def _gguf() -> Any:
    """The `gguf` module, or a MissingExtraError that says how to install it."""
    try:
        import gguf
    except ImportError as error:
        raise MissingExtraError(f"GGUF export needs the optional extra `gguf`: run "
                                f"{GGUF_INSTALL_HINT} ({error})") from error
    return gguf


# --- the architecture --------------------------------------------------------------------------


def gguf_architecture(config: GPTConfig) -> GGUFArchitecture:
    """How llama.cpp computes what `config` does (its family's record), or a ConfigError naming
    the setting it lacks: the family `convert --to-hf` exports, its own refusals, and the few
    places where llama.cpp's version of the family computes less than transformers'."""
    family, chosen_by = family_choice(config)
    layout = family.gguf
    if layout is None:
        raise ConfigError(f"{chosen_by} makes this a {family.title} model, which glassgpt does "
                          f"not write as GGUF ({_written_families()} only)")
    family_settings(family, chosen_by, config)
    for limit in layout.limits:
        if not limit.holds(config):
            raise ConfigError(f"{limit.setting}={getattr(config, limit.setting)!r} cannot be "
                              f"written as GGUF: {limit.why.format(config=config)}")
    if config.rope_scaling == "llama3" and not layout.rope_factors:
        raise ConfigError(f"rope_scaling='llama3' cannot be written as GGUF for {family.title}: "
                          f"llama.cpp reads its rotary factors in the llama architecture only")
    return layout


def _written_families() -> str:
    """"GPT-2, Llama, Qwen2 and Qwen3": the families with a GGUF record."""
    titles = sorted(arch.title for arch in ARCHITECTURES.values() if arch.gguf is not None)
    return f"{', '.join(titles[:-1])} and {titles[-1]}"


# --- the tensors -------------------------------------------------------------------------------


def _tensors(model: GPT, layout: GGUFArchitecture) -> dict[str, Tensor]:
    """llama.cpp's name -> the float32 tensor on the CPU, each of `model`'s weights once, in
    the order of `layout`'s table; a ConfigError for a tensor GGUF has no place for (a LoRA
    adapter not merged)."""
    config: GPTConfig = model.config
    ours = {name: tensor.detach().to("cpu", torch.float32)
            for name, tensor in model.state_dict().items()}
    if config.tie_weights:  # llama.cpp reads token_embd as the head when output is missing
        ours.pop("lm_head.weight", None)
    missing = [name for name in expected_shapes(config) if name not in ours]
    if missing:
        raise ConfigError(f"the model has no {missing[0]!r} tensor; write a plain glassgpt GPT")
    out = {}
    for mine, theirs in _in_file_order(layout.names, config.n_layer):
        if mine in ours:
            out.update(_named(ours.pop(mine), theirs, layout, config))
    if ours:
        raise ConfigError(f"the model holds tensors GGUF has no place for ({', '.join(ours)[:80]}"
                          f"); merge a LoRA adapter first (glassgpt.adapters.lora.bake_lora)")
    if config.rope_scaling == "llama3":
        out["rope_freqs.weight"] = _llama3_factors(config)
    return out


def _in_file_order(names: dict[str, str | tuple[str, ...]], n_layer: int
                   ) -> Iterator[tuple[str, str | tuple[str, ...]]]:
    """(our name, GGUF name or names) of every row of a GGUF table, a block's rows once per
    layer at the place of the first of them, "{i}" filled in."""
    rows = list(names.items())
    blocks = [(mine, theirs) for mine, theirs in rows if mine.startswith("blocks.")]
    first = next(i for i, (mine, _) in enumerate(rows) if mine.startswith("blocks."))
    yield from rows[:first]
    for i in range(n_layer):
        for mine, theirs in blocks:
            yield mine.format(i=i), (theirs.format(i=i) if isinstance(theirs, str)
                                     else tuple(part.format(i=i) for part in theirs))
    yield from (row for row in rows[first:] if not row[0].startswith("blocks."))


def _named(tensor: Tensor, theirs: str | tuple[str, ...], layout: GGUFArchitecture,
           config: GPTConfig) -> dict[str, Tensor]:
    """One of our tensors under its GGUF name, or cut into the q, k and v tensors `theirs`
    names (our qkv's rows are [Q, K, V]), each head's q and k rows reordered where llama.cpp
    rotates adjacent pairs."""
    if isinstance(theirs, str):
        return {theirs: tensor}
    q, k, v = tensor.split([config.q_width, config.kv_width, config.kv_width])
    if layout.adjacent_pairs:
        q = pairs_side_by_side(q, config.n_head)
        k = pairs_side_by_side(k, config.n_kv_head or config.n_head)
    return dict(zip(theirs, (q, k, v), strict=True))


def pairs_side_by_side(rows: Tensor, n_heads: int) -> Tensor:
    """q or k rows (n_heads * d, ...) reordered within each head from rotate-half's pairs
    (feature i with i + d/2) to adjacent ones (2i with 2i + 1), llama.cpp's `llama` rotary:
    row 2i + t of a head is its row t * d/2 + i."""
    d = rows.shape[0] // n_heads
    halves = rows.reshape(n_heads, 2, d // 2, *rows.shape[1:])  # (H, 2, d/2, ...)
    return halves.transpose(1, 2).reshape(rows.shape)  # (H, d/2, 2, ...) -> (H * d, ...)


def _llama3_factors(config: GPTConfig) -> Tensor:
    """What llama.cpp divides each pair's angle by (rope_freqs, (d/2,)): glassgpt's own
    unscaled over scaled frequencies, computed in float64."""
    plain = rotary_frequencies(config.head_dim, config.rope_theta, None, torch.float64)
    scaled = rotary_frequencies(config.head_dim, config.rope_theta,
                                RopeScaling.from_config(config), torch.float64)
    return (plain / scaled).float()


def _typed(gguf: Any, tensors: dict[str, Tensor], dtype: str
           ) -> tuple[dict[str, tuple[np.ndarray, Any]], list[str]]:
    """Each tensor as the bytes of its GGUF type, and notes: 2-D weights in `dtype`; vectors
    and the position table float32 (llama.cpp reads them so); q8_0 of a row length that is no
    multiple of 32 as f16 (llama.cpp's converter's fallback)."""
    qtypes = gguf.GGMLQuantizationType
    wanted = {"f32": qtypes.F32, "f16": qtypes.F16, "bf16": qtypes.BF16, "q8_0": qtypes.Q8_0,
              "q4_0": qtypes.Q4_0}
    written, fallen_back = {}, []
    for name, tensor in tensors.items():
        qtype = wanted[dtype]
        if tensor.ndim < 2 or name == "position_embd.weight":
            qtype = qtypes.F32
        data = tensor.numpy()
        try:
            check_in_range(name, data, LARGEST.get(qtype.name), dtype)
            written[name] = (gguf.quants.quantize(data, qtype), qtype)
        except gguf.QuantError:
            check_in_range(name, data, F16_MAX, dtype)
            written[name] = (gguf.quants.quantize(data, qtypes.F16), qtypes.F16)
            fallen_back.append(name)
    notes = [] if not fallen_back else [
        f"{len(fallen_back)} matrices are f16, not {dtype}: their rows are not a multiple of 32 "
        f"long ({dtype}'s block), e.g. {fallen_back[0]}"]
    return written, notes


# The largest magnitude each narrow type holds: f16's largest finite value, bf16's, and q8_0's
# and q4_0's, whose block scale (the block's largest magnitude / 127, or / 8) is itself an f16.
F16_MAX = 65504.0
LARGEST = {"F16": F16_MAX, "BF16": float(torch.finfo(torch.bfloat16).max), "Q8_0": F16_MAX * 127,
           "Q4_0": F16_MAX * 8}


def check_in_range(name: str, data: np.ndarray, largest: float | None, dtype: str) -> None:
    """Refuse a tensor whose values its GGUF type cannot hold: written, they would be
    infinities that llama.cpp computes with, where the run holds finite weights."""
    if largest is None or data.size == 0:
        return
    biggest = float(np.abs(data).max())
    if biggest > largest:
        raise CheckpointError(f"{name} holds {biggest:.3g}, more than {dtype} can hold (about "
                              f"{largest:.3g}): the GGUF file would hold infinities; export "
                              f"with --dtype f32")


# --- the settings ------------------------------------------------------------------------------


def _add_settings(writer: Any, gguf: Any, config: GPTConfig, layout: GGUFArchitecture,
                  dtype: str, name: str) -> None:
    """general.* and the architecture's keys: what llama.cpp reads to build the model, the
    shape every architecture writes alike, then the record's own settings."""
    file_types = gguf.LlamaFileType
    writer.add_name(name)
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_file_type({"f32": file_types.ALL_F32, "f16": file_types.MOSTLY_F16,
                          "bf16": file_types.MOSTLY_BF16, "q8_0": file_types.MOSTLY_Q8_0,
                          "q4_0": file_types.MOSTLY_Q4_0}[dtype])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_vocab_size(config.vocab_size)
    writer.add_context_length(config.block_size)
    writer.add_embedding_length(config.n_embd)
    writer.add_block_count(config.n_layer)
    writer.add_feed_forward_length(config.hidden_width)
    writer.add_head_count(config.n_head)
    writer.add_head_count_kv(config.n_kv_head or config.n_head)
    for setting in layout.settings:
        value = setting.value(config)
        if value is not None:
            getattr(writer, f"add_{setting.kind}")(setting.key.format(arch=layout.name), value)
