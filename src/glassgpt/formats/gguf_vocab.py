"""The vocabulary of a GGUF file (`tokenizer.ggml.*`): a glassgpt tokenizer as llama.cpp's
tokenizers read it, so that llama.cpp turns a text into glassgpt's ids (glassgpt.formats.gguf writes
the rest of the file).

  * byte-level BPE: model "gpt2" with the tokens (byte-level strings; added tokens as they are,
    CONTROL when special, UNUSED for a model's padding ids), the merges, the end-of-text and
    chat end-of-turn ids, whether a text starts with a begin token (Llama 3's), the run's chat
    template, and the name of the pre-tokenizer, for llama.cpp splits text with its own code
    for each name: GPT-2's regex ("gpt-2": glassgpt's own BPE, GPT-2's), digits apart before
    it ("smollm": SmolLM2), Qwen2's split ("qwen2": Qwen2/2.5/3) and Llama 3's ("llama-bpe").
    Another split is refused by name. A Qwen normalizer (NFC) is kept out, as llama.cpp's own
    converter does: text already in NFC, nearly all text, splits the same.
  * character-level: model "rwkv", each character one token. llama.cpp's RWKV tokenizer is a
    greedy longest match over the tokens' bytes, which over single characters is exactly
    glassgpt's char tokenizer, for any character; and it has no end-of-sequence token (a
    "gpt2" vocabulary always has one, id 11 when none is named, and would end generation at
    that character; it would also need merges, of which a character vocabulary has none).
  * no tokenizer: the same "rwkv" model over placeholder tokens `<|id:N|>`: llama.cpp loads
    the file and runs ids, each printed as its number. (llama.cpp's "none" vocabulary would
    abort the process at the first text it was asked to print.)
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from glassgpt.errors import TokenizerError
from glassgpt.formats.files import UNUSED_TOKEN
from glassgpt.tokenizers import END_OF_TEXT, BPETokenizer, CharTokenizer, Tokenizer

if TYPE_CHECKING:
    from glassgpt.tokenizers.chat import ChatTemplate

PLACEHOLDER_TOKEN = "<|id:{id}|>"
# llama.cpp's pre-tokenizer name for each split a byte-level tokenizer.json can hold: the
# GPT-2 regex of a ByteLevel step (glassgpt's own BPE, GPT-2's), digits apart before it
# (SmolLM), or a Split regex before a ByteLevel without one (Qwen2/2.5/3, Llama 3).
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+"
               r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_SPLIT = QWEN2_SPLIT.replace(r"|\p{N}|", r"|\p{N}{1,3}|")
SPLIT_PRE_TOKENIZERS = {QWEN2_SPLIT: "qwen2", LLAMA3_SPLIT: "llama-bpe"}


@dataclass(frozen=True)
class GGUFVocabulary:
    """tokenizer.ggml.*: the model, the tokens and their types, and the rest (`settings`: key
    suffix -> value, e.g. "pre", "merges", "eos_token_id", "add_bos_token")."""

    model: str
    tokens: list[str]
    types: list[int]
    settings: dict[str, Any]
    summary: str


def gguf_vocabulary(tokenizer: Tokenizer | None, vocab_size: int,
                    chat: ChatTemplate | None = None) -> GGUFVocabulary:
    """The vocabulary of `tokenizer` for a model of `vocab_size` ids (checked: each id one
    distinct token), or a TokenizerError naming what llama.cpp could not tokenize alike."""
    if tokenizer is None:
        tokens = [PLACEHOLDER_TOKEN.format(id=i) for i in range(vocab_size)]
        return GGUFVocabulary("rwkv", tokens, [1] * vocab_size, {},
                              f"{vocab_size} placeholder tokens (no tokenizer)")
    if isinstance(tokenizer, CharTokenizer):
        vocabulary = _char_vocabulary(tokenizer, vocab_size)
    elif isinstance(tokenizer, BPETokenizer):
        vocabulary = _bpe_vocabulary(tokenizer, vocab_size, chat)
    else:
        raise TokenizerError(f"a {tokenizer.kind} tokenizer cannot be written as GGUF (byte-level "
                             f"BPE and character-level only)")
    if len(set(vocabulary.tokens)) != len(vocabulary.tokens):  # llama.cpp maps text -> id
        raise TokenizerError("the tokenizer names two ids alike, which llama.cpp cannot hold")
    return vocabulary


def _char_vocabulary(tokenizer: CharTokenizer, vocab_size: int) -> GGUFVocabulary:
    if tokenizer.vocab_size != vocab_size:
        raise TokenizerError(f"the character tokenizer has {tokenizer.vocab_size} tokens and "
                             f"the model {vocab_size} ids; GGUF needs one token per id")
    tokens = [rwkv_escaped(char) for char in tokenizer.chars]
    return GGUFVocabulary("rwkv", tokens, [1] * vocab_size, {},
                          f"{vocab_size} characters (llama.cpp's rwkv tokenizer)")


def rwkv_escaped(char: str) -> str:
    """A character as llama.cpp's RWKV vocabulary writes it: backslash escapes for the
    backslash, tab, newline, carriage return and other control characters (\\xHH), the rest
    as it is (UTF-8 in the file)."""
    named = {"\\": "\\\\", "\t": "\\t", "\n": "\\n", "\r": "\\r"}
    if char in named:
        return named[char]
    return f"\\x{ord(char):02x}" if ord(char) < 0x20 or ord(char) == 0x7F else char


def _bpe_vocabulary(tokenizer: BPETokenizer, vocab_size: int,
                    chat: ChatTemplate | None) -> GGUFVocabulary:
    data = json.loads(tokenizer.to_json())
    model = data.get("model") or {}
    pre = pre_tokenizer_name(data)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
    if not merges:  # llama.cpp's BPE needs the key, and gguf writes no empty list
        raise TokenizerError("a BPE tokenizer without merges cannot be written as GGUF")
    tokens, types = _bpe_tokens(tokenizer, vocab_size)
    settings: dict[str, Any] = {"pre": pre, "merges": merges, **_special_ids(tokenizer, chat)}
    if chat is not None:
        settings["chat_template"] = chat.template
    return GGUFVocabulary("gpt2", tokens, types, settings,
                          f"{tokenizer.vocab_size} BPE tokens (pre-tokenizer {pre})")


def pre_tokenizer_name(data: dict[str, Any]) -> str:
    """llama.cpp's name of the pre-tokenizer of a tokenizer.json (`data`), or a TokenizerError:
    llama.cpp splits text with its own code for each name, so only a known split is exact."""
    split = data.get("pre_tokenizer") or {}
    steps = split.get("pretokenizers", []) if split.get("type") == "Sequence" else [split]
    kinds = [step.get("type") for step in steps]
    byte_level = steps[-1] if kinds and kinds[-1] == "ByteLevel" else None
    name = None
    if byte_level is not None and not byte_level.get("add_prefix_space", True):
        with_regex = byte_level.get("use_regex", True)
        if kinds == ["ByteLevel"] and with_regex:
            name = "gpt-2"
        elif kinds == ["Digits", "ByteLevel"] and with_regex and steps[0].get(
                "individual_digits"):
            name = "smollm"
        elif kinds == ["Split", "ByteLevel"] and not with_regex and not steps[0].get("invert"):
            name = SPLIT_PRE_TOKENIZERS.get((steps[0].get("pattern") or {}).get("Regex"))
    normalizer = (data.get("normalizer") or {}).get("type")
    if name is None or normalizer not in (None, "NFC"):
        raise TokenizerError(f"the tokenizer's pre-tokenizer ({' + '.join(map(str, kinds))}"
                             f"{', normalizer ' + normalizer if normalizer else ''}) is none "
                             f"that llama.cpp splits alike; GGUF export takes GPT-2's, SmolLM's, "
                             f"Qwen2's and Llama 3's")
    if bool((data.get("model") or {}).get("ignore_merges")) != (name == "llama-bpe"):
        raise TokenizerError(f"the tokenizer's ignore_merges setting is not llama.cpp's for "
                             f"its pre-tokenizer ({name})")
    return name


def _bpe_tokens(tokenizer: BPETokenizer, vocab_size: int) -> tuple[list[str], list[int]]:
    """Each id's token and its type: NORMAL (1), CONTROL (3, a special added token),
    USER_DEFINED (4, another added token), UNUSED (5: padding ids)."""
    hf = tokenizer.tokenizer
    added = hf.get_added_tokens_decoder()
    tokens, types = [], []
    for i in range(vocab_size):
        if i in added:
            token = added[i].content
            kind = 5 if token == UNUSED_TOKEN.format(id=i) else 3 if added[i].special else 4
        else:
            token = hf.id_to_token(i)
            kind = 1
            if token is None:  # a hole in the vocabulary, or the model's padding
                token, kind = f"[PAD{i}]", 5
        tokens.append(token)
        types.append(kind)
    return tokens, types


def _special_ids(tokenizer: BPETokenizer, chat: ChatTemplate | None) -> dict[str, Any]:
    """End-of-sequence (the chat template's eos_token, else <|endoftext|>), end-of-turn (the
    template's, when another), begin-of-sequence and whether text starts with it (the
    tokenizer's own leading special token, Llama 3's)."""
    def one_id(text: str | None) -> int | None:
        ids = tokenizer.tokenizer.encode(text, add_special_tokens=False).ids if text else []
        return ids[0] if len(ids) == 1 else None

    special = chat.special_tokens if chat is not None else {}
    eos = one_id(special.get("eos_token"))
    eos = one_id(END_OF_TEXT) if eos is None else eos
    leading = tokenizer.leading_special_ids()
    bos = leading[0] if leading else one_id(special.get("bos_token"))
    bos = eos if bos is None else bos  # GPT-2's own: <|endoftext|> begins and ends
    settings: dict[str, Any] = {"add_bos_token": bool(leading), "add_eos_token": False}
    if eos is not None:
        settings["eos_token_id"] = eos
    if bos is not None:
        settings["bos_token_id"] = bos
    eot = one_id(chat.end_of_turn) if chat is not None else None
    if eot is not None and eot != eos:
        settings["eot_token_id"] = eot
    return settings


def add_vocabulary(writer: Any, vocabulary: GGUFVocabulary) -> None:
    writer.add_tokenizer_model(vocabulary.model)
    writer.add_token_list(vocabulary.tokens)
    writer.add_token_types(vocabulary.types)
    for key, value in vocabulary.settings.items():
        if isinstance(value, bool):
            writer.add_bool(f"tokenizer.ggml.{key}", value)
        elif isinstance(value, int):
            writer.add_uint32(f"tokenizer.ggml.{key}", value)
        elif key == "chat_template":
            writer.add_chat_template(value)
        elif isinstance(value, list):
            writer.add_array(f"tokenizer.ggml.{key}", value)
        else:
            writer.add_string(f"tokenizer.ggml.{key}", value)
