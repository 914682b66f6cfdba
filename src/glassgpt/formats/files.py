"""Hugging Face save_pretrained directories, read by glassgpt itself and never trusted.

`transformers` would unpickle a `pytorch_model.bin` (even with weights_only, an attack surface),
follow an index into another directory, and hand a 100,000-deep config.json to a recursive
parser. So glassgpt reads these directories on its own:
  * config.json as bounded JSON, each setting of its architecture (GPT-2, Llama, Qwen3, ...)
    type-checked (a size is an integer, not the string "32"; a flag is true or false:
    glassgpt.formats.hf_settings);
  * weights from `.safetensors` files only: `model.safetensors`, or the files that
    `model.safetensors.index.json` names, which must be plain names inside the directory;
    a directory holding only pickles is refused by name, before anything is opened;
  * tokenizer.json (or GPT-2's vocab.json + merges.txt) as bounded files;
  * the chat template (chat_template.jinja, or tokenizer_config.json's `chat_template`) as
    text, never run here (glassgpt.tokenizers.chat renders it in a sandbox).
An export glassgpt writes carries its marker (EXPORT_MARKER); only such a directory may be
replaced by a newer export.
A hub name is downloaded with huggingface_hub, asking for exactly those files, into its cache.
How the tensors map onto a glassgpt model is glassgpt.formats.interop's business.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from torch import Tensor

from glassgpt.config import INSTALL_HINT  # its home: no torch, for --help
from glassgpt.errors import CheckpointError, GlassGPTError, TokenizerError
from glassgpt.formats.hf_settings import checked_settings, is_int
from glassgpt.rundir.weights import check_fits_memory
from glassgpt.storage import files
from glassgpt.storage.tensorfile import SafetensorsFile, check_finite, check_float_dtypes
from glassgpt.tokenizers import END_OF_TEXT
from glassgpt.tokenizers.chat import SPECIAL_TOKEN_NAMES, ChatTemplate, checked_template

if TYPE_CHECKING:
    from tokenizers import Tokenizer

HF_CONFIG_FILE = "config.json"
HF_WEIGHTS_FILE = "model.safetensors"
HF_INDEX_FILE = "model.safetensors.index.json"
SAFETENSORS_SUFFIX = ".safetensors"
# All a hub download may fetch: JSON, text and safetensors, never a pickle.
HF_TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
HF_CHAT_TEMPLATE_FILE = "chat_template.jinja"  # where transformers 5 saves the template
HUB_FILES = [HF_CONFIG_FILE, "*" + SAFETENSORS_SUFFIX, HF_INDEX_FILE, "tokenizer.json",
             "vocab.json", "merges.txt", HF_TOKENIZER_CONFIG_FILE, HF_CHAT_TEMPLATE_FILE]
PICKLED_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
MAX_WEIGHT_FILES = 10_000
MAX_TOKENIZER_BYTES = 64 * 2**20
UNUSED_TOKEN = "<|unused:{id}|>"  # the name of an id a model has beyond its tokenizer's
PADDING_LIMIT = 4096  # ids named so; a wider gap is another model's tokenizer
# transformers writes int(1e30) (its VERY_LARGE_INTEGER) as a tokenizer's model_max_length when
# the model sets none; HFDirectory.tokenizer_config reads it there, as None, and nowhere else.
HF_NO_LIMIT = str(int(1e30))
_NO_LIMIT = object()  # what HF_NO_LIMIT is read as until its place is checked
# Checkpoints written by older `transformers` hold the causal mask and its fill value as buffers.
MASK_BUFFER_SUFFIXES = (".attn.bias", ".attn.masked_bias")



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
        """config.json, type-checked, with its architecture's defaults for what it leaves out.

        A model_type glassgpt does not know comes back alone (interop names it); a config.json
        without one is GPT-2's, as GPT2Config reads it.
        """
        path = self.path(HF_CONFIG_FILE)
        if path is None:
            raise CheckpointError(f"cannot load a Hugging Face model from {self.name}: it has "
                                  f"no {HF_CONFIG_FILE} (is it a save_pretrained directory?)")
        return checked_settings(files.read_json_object(path, CheckpointError), path)

    def tokenizer_config(self) -> dict[str, Any]:
        """tokenizer_config.json ({} when there is none), read as strictly as any JSON file
        but for the one number transformers writes beyond 64 bits: `model_max_length`
        10**30, its "no limit", read as None. Anywhere else that number is refused."""
        path = self.path(HF_TOKENIZER_CONFIG_FILE)
        if path is None:
            return {}
        config = files.read_json_object(path, CheckpointError, MAX_TOKENIZER_BYTES,
                                        read_as={HF_NO_LIMIT: _NO_LIMIT})
        if config.get("model_max_length") is _NO_LIMIT:
            config["model_max_length"] = None
        if _holds(config, _NO_LIMIT):
            raise CheckpointError(f"{path}: integer {HF_NO_LIMIT} does not fit in 64 bits "
                                  f"(transformers writes it only as model_max_length)")
        return config

    def chat_template(self) -> ChatTemplate | None:
        """The tokenizer's chat template (chat_template.jinja, else tokenizer_config.json's
        `chat_template`, its default when it names several), with the special tokens that
        tokenizer_config.json names; None when the model has none (a base model)."""
        config = self.tokenizer_config()
        jinja = self.path(HF_CHAT_TEMPLATE_FILE)
        if jinja is not None:
            template = files.read_text(jinja, MAX_TOKENIZER_BYTES, CheckpointError)
        else:
            template = _default_template(config.get("chat_template"),
                                         self.path(HF_TOKENIZER_CONFIG_FILE))
        if template is None:
            return None
        special = {name: _token_text(config.get(name)) for name in SPECIAL_TOKEN_NAMES}
        special = {name: text for name, text in special.items() if text is not None}
        try:
            return ChatTemplate(checked_template(template, self.name),
                                special.get("eos_token"), special)
        except TokenizerError as error:
            raise CheckpointError(str(error)) from None

    @contextlib.contextmanager
    def weights(self, base_prefix: str = "transformer.",
                skipped: tuple[str, ...] = MASK_BUFFER_SUFFIXES,
                stored_names: dict[str, str] | None = None) -> Iterator[StoredWeights]:
        """The weight files, open, their headers checked; nothing read yet. `base_prefix`,
        `skipped` and `stored_names` are the architecture's (see StoredWeights)."""
        with contextlib.ExitStack() as stack:
            opened = [stack.enter_context(SafetensorsFile(path, CheckpointError))
                      for path in self._weight_files()]
            yield StoredWeights(opened, self.name, base_prefix, skipped, stored_names)

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
        raise CheckpointError(f"cannot load a Hugging Face model from {self.name}: it has no "
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

    A checkpoint of the base model alone (GPT2Model, as the hub's `gpt2`; LlamaModel) stores
    names without the prefix of the model inside the LM (`base_prefix`: `transformer.`,
    `model.`); it is added. Buffers old checkpoints kept beside the weights (names ending in
    one of `skipped`: GPT-2's mask, Llama's rotary frequencies) are not weights and are skipped.
    A tensor stored under an older name (`stored_names`' keys: GPT-NeoX's `embed_out.weight`)
    goes by the installed transformers' name (its value: `lm_head.weight`).
    """

    def __init__(self, opened: list[SafetensorsFile], source: str,
                 base_prefix: str = "transformer.",
                 skipped: tuple[str, ...] = MASK_BUFFER_SUFFIXES,
                 stored_names: dict[str, str] | None = None):
        self.source = source
        self._where: dict[str, tuple[SafetensorsFile, str]] = {}
        current = stored_names or {}
        for file in opened:
            check_float_dtypes(file.header, file.path, CheckpointError)
            for stored in file.header:
                if stored.endswith(skipped):
                    continue
                name = current.get(stored, stored)
                name = name if name.startswith((base_prefix, "lm_head.")) \
                    else base_prefix + name
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


def _default_template(value: Any, path: Path | None) -> str | None:
    """tokenizer_config.json's `chat_template`: a string, or a list of {"name", "template"}
    of which transformers uses the one named "default"."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(t, dict) for t in value):
        named = {t.get("name"): t.get("template") for t in value}
        if isinstance(named.get("default"), str):
            return named["default"]
    raise CheckpointError(f"{path}: chat_template must be a string, or a list of "
                          f"{{name, template}} with one named 'default'")


def _holds(data: Any, target: object) -> bool:
    """Whether parsed JSON `data` holds `target` anywhere (walked without recursion)."""
    pending = [data]
    while pending:
        value = pending.pop()
        if value is target:
            return True
        if isinstance(value, dict):
            pending.extend(value.values())
        elif isinstance(value, list):
            pending.extend(value)
    return False


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json gives it: its text, or an AddedToken's
    {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


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


def name_padding_ids(tokenizer: Tokenizer, vocab_size: int) -> int:
    """Give a name to each id a model has beyond its tokenizer's, so that every id it can emit
    decodes; returns how many were named.

    Models pad their embedding past the tokenizer for speed (Qwen3: 151,936 rows for 151,669
    tokens). Each extra id becomes a special token `<|unused:ID|>`: the model never learned to
    emit those ids, and if it does the text says so. Only a padding's worth is named; a gap
    wider than PADDING_LIMIT means another model's tokenizer, which the caller refuses.
    """
    start = tokenizer.get_vocab_size()
    if not 0 < vocab_size - start <= PADDING_LIMIT:
        return 0
    tokens = [_tokenizers().AddedToken(UNUSED_TOKEN.format(id=i), special=True)
              for i in range(start, vocab_size)]
    tokenizer.add_special_tokens(tokens)
    if tokenizer.token_to_id(UNUSED_TOKEN.format(id=vocab_size - 1)) != vocab_size - 1:
        raise CheckpointError(f"cannot name the ids {start}..{vocab_size - 1} the tokenizer "
                              f"lacks (one of its names is taken)")
    return vocab_size - start


def _byte_level_bpe(vocab_path: Path, merges_path: Path) -> Tokenizer:
    """GPT-2's tokenizer from its vocab.json and merges.txt, as transformers builds it."""
    tokenizers = _tokenizers()
    vocab = files.read_json_object(vocab_path, CheckpointError, MAX_TOKENIZER_BYTES)
    if not all(is_int(i) and i >= 0 for i in vocab.values()):
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

# glassgpt's own mark on an export: what `--force` may replace is recognised by it, never by a
# config.json (the user's own model directory has one too).
EXPORT_MARKER = "glassgpt-export.json"
EXPORT_MARK = {"written_by": "glassgpt convert --to-hf",
               "note": "glassgpt may replace this directory (with --force) by a newer export"}


def write_export_marker(directory: Path) -> None:
    (directory / EXPORT_MARKER).write_text(json.dumps(EXPORT_MARK, indent=2) + "\n",
                                           encoding="utf-8")


def check_replaceable_export(out: Path, overwrite: bool) -> None:
    """Replace a directory only when asked, and only an earlier export glassgpt wrote."""
    if not overwrite:
        raise CheckpointError(f"{out} already exists and is not an empty directory; choose a "
                              f"new one, or replace an earlier export with overwrite=True "
                              f"(--force)")
    if not (out.is_dir() and _holds_export_marker(out)):
        raise CheckpointError(f"{out} does not hold a Hugging Face export glassgpt wrote (no "
                              f"{EXPORT_MARKER}); it is not replaced")


def _holds_export_marker(out: Path) -> bool:
    marker = out / EXPORT_MARKER
    if files.entry_kind(marker) != "file":
        return False
    try:
        mark = files.read_json_object(marker, CheckpointError, 2**16)
    except CheckpointError:
        return False
    return mark.get("written_by") == EXPORT_MARK["written_by"]
