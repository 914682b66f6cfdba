"""Hugging Face save_pretrained directories, read by glassgpt itself and never trusted.

`transformers` would unpickle a `pytorch_model.bin` (even with weights_only, an attack surface),
follow an index into another directory, and hand a 100,000-deep config.json to a recursive
parser. So glassgpt reads these directories on its own:
  * config.json as bounded JSON, each GPT-2 setting type-checked (a size is an integer, not the
    string "32"; a flag is true or false);
  * weights from `.safetensors` files only: `model.safetensors`, or the files that
    `model.safetensors.index.json` names, which must be plain names inside the directory;
    a directory holding only pickles is refused by name, before anything is opened;
  * tokenizer.json (or GPT-2's vocab.json + merges.txt) as bounded files.
A hub name is downloaded with huggingface_hub, asking for exactly those files, into its cache.
How the tensors map onto a glassgpt model is glassgpt.interop's business.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from torch import Tensor

from glassgpt import files
from glassgpt.checkpoint import check_fits_memory
from glassgpt.errors import CheckpointError, ConfigError, GlassGPTError
from glassgpt.tensorfile import SafetensorsFile, check_finite, check_float_dtypes
from glassgpt.tokenizers import END_OF_TEXT

if TYPE_CHECKING:
    from tokenizers import Tokenizer

INSTALL_HINT = "pip install 'glassgpt[hf]'"
HF_CONFIG_FILE = "config.json"
HF_WEIGHTS_FILE = "model.safetensors"
HF_INDEX_FILE = "model.safetensors.index.json"
SAFETENSORS_SUFFIX = ".safetensors"
# All a hub download may fetch: JSON, text and safetensors, never a pickle.
HUB_FILES = [HF_CONFIG_FILE, "*" + SAFETENSORS_SUFFIX, HF_INDEX_FILE, "tokenizer.json",
             "vocab.json", "merges.txt"]
PICKLED_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
MAX_WEIGHT_FILES = 10_000
MAX_TOKENIZER_BYTES = 64 * 2**20
# Checkpoints written by older `transformers` hold the causal mask and its fill value as buffers.
MASK_BUFFER_SUFFIXES = (".attn.bias", ".attn.masked_bias")
# GPT2Config's defaults, for keys a config.json leaves out; and the aliases it accepts.
HF_DEFAULTS: dict[str, Any] = {
    "model_type": "gpt2", "vocab_size": 50257, "n_positions": 1024, "n_embd": 768,
    "n_layer": 12, "n_head": 12, "n_inner": None, "activation_function": "gelu_new",
    "resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_pdrop": 0.1, "layer_norm_epsilon": 1e-5,
    "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
    "add_cross_attention": False, "tie_word_embeddings": True}
HF_ALIASES = {"hidden_size": "n_embd", "num_attention_heads": "n_head",
              "num_hidden_layers": "n_layer", "max_position_embeddings": "n_positions"}


class MissingExtraError(GlassGPTError, ImportError):
    """An optional dependency that a feature needs is not installed."""


class HFDirectory:
    """The files of a save_pretrained directory, each found without following a planted link.

    In a local directory every file must be a regular file right there. A hub snapshot in the
    Hugging Face cache is made of links that huggingface_hub itself made into the cache's blob
    store: those are followed, and only into that store.
    """

    def __init__(self, root: Path, blobs: Path | None = None, name: str | None = None):
        self.root, self.blobs = root, blobs
        self.name = name or str(root)

    def path(self, name: str) -> Path | None:
        """Where file `name` is read from, or None when the directory has none."""
        path = self.root / name
        kind = files.entry_kind(path)
        if kind == "missing":
            return None
        if kind == "link" and self.blobs is not None:
            target = Path(os.path.realpath(path))
            if target.parent != Path(os.path.realpath(self.blobs)):
                raise CheckpointError(f"{path} links outside the Hugging Face cache")
            return target
        return path  # a link or a non-file here is refused, with one line, when it is read

    def settings(self) -> SimpleNamespace:
        """config.json, type-checked, with GPT2Config's defaults for what it leaves out."""
        path = self.path(HF_CONFIG_FILE)
        if path is None:
            raise CheckpointError(f"cannot load a Hugging Face GPT-2 from {self.name}: it has "
                                  f"no {HF_CONFIG_FILE} (is it a save_pretrained directory?)")
        raw = files.read_json_object(path, CheckpointError)
        for alias, key in HF_ALIASES.items():
            if alias in raw and key not in raw:
                raw[key] = raw[alias]
        settings = {key: raw.get(key, default) for key, default in HF_DEFAULTS.items()}
        for key, value in settings.items():
            _check_setting(key, value, HF_DEFAULTS[key], path)
        return SimpleNamespace(**settings)

    @contextlib.contextmanager
    def weights(self) -> Iterator[StoredWeights]:
        """The weight files, open, their headers checked; nothing read yet."""
        with contextlib.ExitStack() as stack:
            opened = [stack.enter_context(SafetensorsFile(path, CheckpointError))
                      for path in self._weight_files()]
            yield StoredWeights(opened, self.name)

    def _weight_files(self) -> list[Path]:
        """model.safetensors, or the files its index names: only .safetensors files in this
        directory, never a pickle, never a path that leaves it."""
        single = self.path(HF_WEIGHTS_FILE)
        if single is not None:
            return [single]
        index = self.path(HF_INDEX_FILE)
        if index is not None:
            return [self._indexed_file(name, index) for name in _indexed_names(index)]
        pickles = sorted(p.name for p in self.root.iterdir() if p.suffix in PICKLED_SUFFIXES)
        if pickles:
            raise CheckpointError(f"{self.name} holds only pickled weights "
                                  f"({', '.join(pickles[:3])}); glassgpt never unpickles files "
                                  f"(they can run code): save the model with safetensors "
                                  f"(save_pretrained does by default) where you trust it")
        raise CheckpointError(f"cannot load a Hugging Face GPT-2 from {self.name}: it has no "
                              f"{HF_WEIGHTS_FILE}")

    def _indexed_file(self, name: str, index: Path) -> Path:
        if (name != Path(name).name or name in (".", "..") or "\\" in name
                or not name.endswith(SAFETENSORS_SUFFIX)):
            raise CheckpointError(f"{index} names {name!r:.80}; only .safetensors files inside "
                                  f"{self.name} are read (never a pickle, never another "
                                  f"directory)")
        path = self.path(name)
        if path is None:
            raise CheckpointError(f"{index} names {name}, which {self.name} does not hold")
        return path


class StoredWeights:
    """The tensors of a directory's weight files, by HF name, before any is read.

    A GPT2Model checkpoint (the hub's `gpt2`) stores names without the `transformer.` prefix;
    it is added. Mask buffers of old checkpoints are skipped.
    """

    def __init__(self, opened: list[SafetensorsFile], source: str):
        self.source = source
        self._where: dict[str, tuple[SafetensorsFile, str]] = {}
        for file in opened:
            check_float_dtypes(file.header, file.path, CheckpointError)
            for stored in file.header:
                if stored.endswith(MASK_BUFFER_SUFFIXES):
                    continue
                name = stored if stored.startswith(("transformer.", "lm_head.")) \
                    else "transformer." + stored
                if name in self._where:
                    raise CheckpointError(f"tensor {stored} is stored twice "
                                          f"({self._where[name][0].path} and {file.path})")
                self._where[name] = (file, stored)

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: file.header[stored].shape for name, (file, stored) in self._where.items()}

    def read(self, names: list[str]) -> dict[str, Tensor]:
        """Tensors `names` (checked by the caller against a config), after a memory check;
        NaN or infinite values are refused."""
        infos = [self._where[name][0].header[self._where[name][1]] for name in names]
        params = sum(math.prod(info.shape) for info in infos)
        check_fits_memory(sum(info.nbytes for info in infos) + 4 * params,
                          f"the model in {self.source}")
        tensors = {name: self._where[name][0].read(self._where[name][1]) for name in names}
        check_finite(tensors, self.source, CheckpointError)
        return tensors


def _indexed_names(index: Path) -> list[str]:
    weight_map = files.read_json_object(index, CheckpointError).get("weight_map")
    if not (isinstance(weight_map, dict) and weight_map
            and all(isinstance(v, str) for v in weight_map.values())):
        raise CheckpointError(f"{index}: 'weight_map' must map tensor names to file names")
    names = sorted(set(weight_map.values()))
    if len(names) > MAX_WEIGHT_FILES:
        raise CheckpointError(f"{index} names {len(names):,} files; at most "
                              f"{MAX_WEIGHT_FILES:,} are read")
    return names


def _check_setting(key: str, value: Any, default: Any, path: Path) -> None:
    """One config.json value has the type GPT2Config gives it (a size is not "32", a flag is
    not 1, a float is a number); ranges are GPTConfig's to check."""
    if default is None:  # n_inner: an int or null
        ok, kind = value is None or _is_int(value), "an integer or null"
    elif isinstance(default, bool):
        ok, kind = isinstance(value, bool), "true or false"
    elif isinstance(default, int):
        ok, kind = _is_int(value), "an integer"
    elif isinstance(default, float):
        ok, kind = _is_int(value) or isinstance(value, float), "a number"
    else:
        ok, kind = isinstance(value, str), "a string"
    if not ok:
        raise ConfigError(f"{path}: {key} must be {kind}, got {value!r:.40}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# --- where a model comes from ----------------------------------------------------------------

def open_hf_source(name_or_dir: str | os.PathLike[str]) -> HFDirectory:
    """A local save_pretrained directory, or a hub model downloaded (JSON, text and
    safetensors files only) into the Hugging Face cache."""
    path = Path(name_or_dir).expanduser()
    if path.exists() and not path.is_dir():
        raise CheckpointError(f"{path} is a file; give a directory written by save_pretrained "
                              f"or a Hugging Face hub name such as 'gpt2'")
    if path.is_dir():
        return HFDirectory(path)
    try:
        from huggingface_hub import snapshot_download
    except ImportError as error:
        raise MissingExtraError(f"downloading from the Hugging Face hub needs the optional "
                                f"extra `hf`: run {INSTALL_HINT} ({error})") from error
    try:
        snapshot = Path(snapshot_download(str(name_or_dir), allow_patterns=HUB_FILES))
    except (OSError, ValueError) as error:  # offline, unknown name, an invalid repo id
        raise CheckpointError(_hub_failure(name_or_dir, error)) from None
    return HFDirectory(snapshot, blobs=snapshot.parents[1] / "blobs", name=str(name_or_dir))


def _hub_failure(name: str | os.PathLike[str], error: Exception) -> str:
    """One line saying what could not be loaded and why (the hub's own message, first line)."""
    reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return (f"cannot load {str(name)!r} from the Hugging Face hub (offline, or not a hub "
            f"model name? no local directory has that name either): {reason}")


# --- tokenizers ------------------------------------------------------------------------------

def load_hf_tokenizer(source: HFDirectory | str | os.PathLike[str]) -> Tokenizer | None:
    """The `tokenizers.Tokenizer` published with a HF model, or None when it has none.

    Read from tokenizer.json, or from GPT-2's vocab.json and merges.txt, as bounded files:
    no `transformers` class is asked to load anything.
    """
    directory = source if isinstance(source, HFDirectory) else open_hf_source(source)
    tokenizer_json = directory.path("tokenizer.json")
    if tokenizer_json is not None:
        text = files.read_text(tokenizer_json, MAX_TOKENIZER_BYTES, CheckpointError)
        files.parse_json(text, str(tokenizer_json), CheckpointError)  # bounded first
        return _built(lambda: _tokenizers().Tokenizer.from_str(text), tokenizer_json)
    vocab, merges = directory.path("vocab.json"), directory.path("merges.txt")
    if vocab is None or merges is None:
        return None
    return _byte_level_bpe(vocab, merges)


def _byte_level_bpe(vocab_path: Path, merges_path: Path) -> Tokenizer:
    """GPT-2's tokenizer from its vocab.json and merges.txt, as transformers builds it."""
    tokenizers = _tokenizers()
    vocab = files.read_json_object(vocab_path, CheckpointError, MAX_TOKENIZER_BYTES)
    if not all(_is_int(i) and i >= 0 for i in vocab.values()):
        raise CheckpointError(f"{vocab_path} must map tokens to ids >= 0")
    lines = files.read_text(merges_path, MAX_TOKENIZER_BYTES, CheckpointError).splitlines()
    merges = [tuple(line.split(" ")) for line in lines if line and not line.startswith("#")]
    if not all(len(pair) == 2 for pair in merges):
        raise CheckpointError(f"{merges_path}: each line must be two tokens and a space")

    def build() -> Tokenizer:
        tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=merges))
        tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = tokenizers.decoders.ByteLevel()
        tokenizer.post_processor = tokenizers.processors.ByteLevel(trim_offsets=False)
        if END_OF_TEXT in vocab:
            tokenizer.add_special_tokens([END_OF_TEXT])
        return tokenizer

    return _built(build, vocab_path)


def _tokenizers() -> Any:
    import tokenizers
    return tokenizers


def _built(build: Callable[[], Any], path: Path) -> Any:
    try:
        return build()
    except Exception as error:  # the tokenizers library raises plain Exceptions
        raise CheckpointError(f"{path} is not a tokenizer glassgpt can use: "
                              f"{str(error)[:200]}") from None


# --- writing an export ------------------------------------------------------------------------

def check_replaceable_export(out: Path, overwrite: bool) -> None:
    """Replace a directory only when asked, and only one that holds an earlier export."""
    if not overwrite:
        raise CheckpointError(f"{out} already exists and is not an empty directory; choose a "
                              f"new one, or replace an earlier export with overwrite=True "
                              f"(--force)")
    config = out / "config.json"
    if not out.is_dir() or files.entry_kind(config) != "file" or \
            '"model_type"' not in files.read_text(config, 2**20, CheckpointError):
        raise CheckpointError(f"{out} does not hold a Hugging Face export (no config.json with "
                              f"a model_type); it is not replaced")


def move_into_place(staging: Path, out: Path, replacing: bool) -> None:
    """Rename the finished directory to `out`; an earlier export there goes only once the new
    one is complete, so a crash leaves one whole export."""
    if not replacing:
        os.replace(staging, out)  # atomic; replaces `out` only when it is an empty directory
        return
    old = out.with_name(f".{out.name}.replaced")
    shutil.rmtree(old, ignore_errors=True)
    os.rename(out, old)
    os.rename(staging, out)
    shutil.rmtree(old, ignore_errors=True)


def usual_permissions(directory: Path) -> None:
    """mkdtemp makes a private directory (0700) and transformers writes some files 0600; the
    export should read like any directory the user writes (their umask decides)."""
    umask = os.umask(0)
    os.umask(umask)
    directory.chmod(0o777 & ~umask)
    for path in directory.iterdir():
        path.chmod(0o666 & ~umask)


def fsync_tree(directory: Path) -> None:
    for path in directory.iterdir():
        with open(path, "rb") as f:
            os.fsync(f.fileno())
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
