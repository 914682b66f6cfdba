"""Tokenizer files: glassgpt's JSON, Hugging Face's tokenizer.json, GPT-2's vocab + merges.

Each is read with bounds (size, JSON depth) through `glassgpt.storage.files`, so a hostile file
gets a one-line TokenizerError instead of exhausting memory or the stack.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from glassgpt.errors import TokenizerError
from glassgpt.storage.files import parse_json, read_json_object, read_text
from glassgpt.tokenizers.base import Tokenizer
from glassgpt.tokenizers.bpe import MAX_BPE_VOCAB, BPETokenizer
from glassgpt.tokenizers.char import CharTokenizer

if TYPE_CHECKING:
    from tokenizers import Tokenizer as HFTokenizer

MAX_FILE_BYTES = 64 * 2**20  # GPT-2's tokenizer.json is 1.4 MB


def tokenizer_from_json(text: str, source: str = "tokenizer JSON") -> Tokenizer:
    """Parse and validate a tokenizer file's contents; `source` names it in errors."""
    data = parse_json(text, source, TokenizerError)
    if not isinstance(data, dict):
        raise TokenizerError(f"{source} must hold a JSON object, got {type(data).__name__}")
    if data.get("kind") == "char":
        unknown = sorted(set(data) - {"kind", "chars"})
        if unknown or not isinstance(data.get("chars"), list):
            raise TokenizerError(f"{source}: a char tokenizer holds exactly 'kind' and a list "
                                 f"'chars' (unknown keys: {unknown})")
        try:
            return CharTokenizer(data["chars"])
        except TokenizerError as error:
            raise TokenizerError(f"{source}: {error}") from None
    if isinstance(data.get("model"), dict):  # the Hugging Face tokenizer.json layout
        check_bpe_model(data, source)
        return BPETokenizer.from_json(text, source)
    raise TokenizerError(f"{source} is neither a glassgpt char tokenizer nor a Hugging Face "
                         f"tokenizer.json")


def check_bpe_model(data: dict, source: str) -> None:
    """A Hugging Face tokenizer.json (parsed) must hold a BPE model: every reader of one (a
    run's tokenizer, `convert --from-hf`) refuses the others alike."""
    kind = data["model"].get("type", "BPE") if isinstance(data.get("model"), dict) else None
    if kind != "BPE":
        raise TokenizerError(f"{source} holds a {kind!r:.40} tokenizer; glassgpt takes "
                             f"byte-level BPE ones")


def tokenizer_from_hf(tokenizer: HFTokenizer, source: str) -> BPETokenizer:
    """A `tokenizers.Tokenizer` as a glassgpt tokenizer, after the checks a run's tokenizer.json
    passes when it is read back (`check_bpe_model`, then text must round-trip), so that a
    tokenizer accepted here is one `sample` accepts too."""
    check_bpe_model(json.loads(tokenizer.to_str()), source)
    return BPETokenizer(tokenizer).checked(source)


def read_tokenizer_file(path: str | Path) -> Tokenizer:
    """The tokenizer.json of a data or run directory: a regular file (never a link), bounded."""
    return tokenizer_from_json(read_text(path, MAX_FILE_BYTES, TokenizerError), str(path))


def load_tokenizer(path: str | Path) -> Tokenizer:
    """A tokenizer file the user names (a link is followed): glassgpt's or a tokenizer.json."""
    return read_tokenizer_file(_user_file(path))


def load_tokenizer_files(paths: str | Path | Sequence[str | Path]) -> Tokenizer:
    """The tokenizer `--tokenizer-file` names: one tokenizer JSON, GPT-2's `vocab.json` and
    `merges.txt` (in that order), or a directory that holds either."""
    paths = [Path(paths)] if isinstance(paths, str | os.PathLike) else [Path(p) for p in paths]
    if len(paths) == 1 and paths[0].is_dir():
        paths = _tokenizer_files_in(paths[0])
    if len(paths) == 1:
        return load_tokenizer(paths[0])
    if len(paths) == 2:
        vocab_path, merges_path = _user_file(paths[0]), _user_file(paths[1])
        return BPETokenizer.from_vocab_and_merges(_read_vocab(vocab_path),
                                                  _read_merges(merges_path),
                                                  f"{vocab_path} and {merges_path}")
    raise TokenizerError(f"give one tokenizer file, or vocab.json and merges.txt; got "
                         f"{len(paths)} paths")


def _tokenizer_files_in(directory: Path) -> list[Path]:
    if (directory / "tokenizer.json").exists():
        return [directory / "tokenizer.json"]
    if (directory / "vocab.json").exists() and (directory / "merges.txt").exists():
        return [directory / "vocab.json", directory / "merges.txt"]
    raise TokenizerError(f"{directory} holds neither tokenizer.json nor vocab.json and "
                         f"merges.txt")


def _user_file(path: str | Path) -> Path:
    """A path the user gave, links resolved (they chose it), that must exist."""
    path = Path(path).expanduser()
    if not path.exists():
        raise TokenizerError(f"tokenizer file not found: {path}")
    return path.resolve()


def _read_vocab(path: Path) -> dict[str, int]:
    """vocab.json: an object mapping each token to its id."""
    vocab = read_json_object(path, TokenizerError, MAX_FILE_BYTES)
    bad = [(token, i) for token, i in vocab.items()
           if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < MAX_BPE_VOCAB]
    if bad:
        raise TokenizerError(f"{path}: a vocab.json maps tokens to ids in [0, "
                             f"{MAX_BPE_VOCAB:,}), got {bad[0]!r:.80}")
    if len(set(vocab.values())) != len(vocab):
        raise TokenizerError(f"{path}: two tokens share an id")
    return vocab


def _read_merges(path: Path) -> list[tuple[str, str]]:
    """merges.txt: an optional '#version' line, then one 'left right' pair per line."""
    merges = []
    # Split on newlines only: byte-level tokens never hold one, but may hold other separators.
    lines = read_text(path, MAX_FILE_BYTES, TokenizerError).split("\n")
    for number, line in enumerate(lines, start=1):
        line = line.removesuffix("\r")
        if not line or (number == 1 and line.startswith("#version")):
            continue
        pair = line.split(" ")
        if len(pair) != 2 or not all(pair):
            raise TokenizerError(f"{path}, line {number}: a merge is two tokens separated by "
                                 f"one space, got {line[:60]!r}")
        merges.append((pair[0], pair[1]))
    return merges
