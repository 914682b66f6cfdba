"""Text in and out of a HookedGPT as TransformerLens code expects it: `LensTokenizer` (a glassgpt
tokenizer with the attributes a Hugging Face tokenizer shows: `bos_token_id`, `len(...)`,
`decode`, ...) and `LensTokenMethods` (`to_tokens`, `to_str_tokens`, `to_string`,
`to_single_token`, `get_token_position`).

What BOS is. TransformerLens puts a begin-of-sequence token before every text by default. A run's
tokenizer has one where it says so:
  * an imported model whose tokenizer starts every text with a special token (Llama 3's
    `<|begin_of_text|>`, Gemma's `<bos>`): that token;
  * otherwise a tokenizer holding the end-of-text token `<|endoftext|>` as one token (GPT-2's,
    every BPE tokenizer glassgpt trains): that token, as GPT-2's BOS is its end-of-text token;
  * otherwise (a character tokenizer, a BPE one without it) there is none: `bos_token_id` is
    None, `cfg.default_prepend_bos` is False, and asking to prepend one is an InputError.
A text that is one token can be named to play BOS (`HookedGPT.from_run(run, bos="\\n")`, a
character run's line break): it becomes `bos_token_id` and `to_tokens` puts it first, as
TransformerLens code expects; a text that is not exactly one token is refused.
The end-of-text token is also `eos_token_id` and the padding token (TransformerLens pads with
it too); a tokenizer without it pads with BOS, and one with neither cannot pad a batch of texts
of different lengths.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from glassgpt.errors import InputError, TokenizerError
from glassgpt.tokenizers import END_OF_TEXT, Tokenizer

PADDING_SIDES = ("right", "left")


def single_id_of(tokenizer: Tokenizer, text: str) -> int | None:
    """The id of `text` when the tokenizer holds it as one token that decodes back to it."""
    try:
        ids = tokenizer.encode(text)
    except TokenizerError:  # a character tokenizer lacking one of its characters
        return None
    if len(ids) != 1 or tokenizer.decode(ids) != text:
        return None
    return ids[0]


def bos_id_of(tokenizer: Tokenizer, bos: object) -> int:
    """The id of `bos`, a text the tokenizer holds as exactly one token; InputError if not."""
    token = single_id_of(tokenizer, bos) if isinstance(bos, str) else None
    if token is None:
        raise InputError(f"bos={bos!r:.40} is not one token of this {tokenizer.kind} tokenizer:"
                         f" give a text it encodes as exactly one token (e.g. a character of"
                         f" its vocabulary)")
    return token


def as_id_list(ids: Any, what: str = "tokens") -> list[int]:
    """An int, a list of ints, or a tensor / array of at most one non-unit axis -> ids."""
    if isinstance(ids, int) and not isinstance(ids, bool):
        return [ids]
    if hasattr(ids, "tolist") and not isinstance(ids, list):
        values = ids.tolist()
        if not isinstance(values, list):
            return [values]
        while len(values) == 1 and isinstance(values[0], list):  # a batch of one row
            values = values[0]
        ids = values
    if not isinstance(ids, Sequence) or isinstance(ids, str) \
            or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise InputError(f"{what} must be token ids (an int, a list of ints or a 1-D tensor), "
                         f"got {ids!r:.60}")
    return list(ids)


class LensTokenizer:
    """A glassgpt tokenizer (`inner`) with the face of a Hugging Face tokenizer that
    TransformerLens code reads: `bos_token_id`, `eos_token_id`, `pad_token_id`, their strings,
    `len(tokenizer)`, `encode`, `decode`, `batch_decode` and `tokenizer(texts)`."""

    def __init__(self, tokenizer: Tokenizer, bos: str | None = None):
        self.inner = tokenizer
        leading = tokenizer.leading_special_ids()
        end_of_text = single_id_of(tokenizer, END_OF_TEXT)
        self.bos_token_id: int | None = leading[0] if leading else end_of_text
        if bos is not None:  # a text of the caller's choosing plays BOS
            self.bos_token_id = bos_id_of(tokenizer, bos)
        self.eos_token_id: int | None = end_of_text
        self.pad_token_id: int | None = end_of_text if end_of_text is not None \
            else self.bos_token_id
        self.padding_side = "right"

    @property
    def bos_token(self) -> str | None:
        return self._text_of(self.bos_token_id)

    @property
    def eos_token(self) -> str | None:
        return self._text_of(self.eos_token_id)

    @property
    def pad_token(self) -> str | None:
        return self._text_of(self.pad_token_id)

    def _text_of(self, token: int | None) -> str | None:
        return None if token is None else self.inner.decode([token])

    @property
    def vocab_size(self) -> int:
        return self.inner.vocab_size

    def __len__(self) -> int:
        return self.inner.vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """`text`'s ids; with `add_special_tokens` the ones Hugging Face's tokenizer puts
        before a text too (a Llama 3 BOS; none for GPT-2 or a tokenizer trained here)."""
        if not isinstance(text, str):
            raise InputError(f"encode takes a string, got {type(text).__name__}")
        leading = self.inner.leading_special_ids() if add_special_tokens else []
        return [*leading, *self.inner.encode(text)]

    def decode(self, ids: Any, **_: Any) -> str:
        """Token ids (an int, a list, a 1-D tensor) -> text; Hugging Face's keyword options
        (skip_special_tokens, clean_up_tokenization_spaces) change nothing here."""
        return self.inner.decode(as_id_list(ids))

    def batch_decode(self, rows: Any, **_: Any) -> list[str]:
        rows = rows.tolist() if isinstance(rows, Tensor) else rows
        return [self.decode(row) for row in rows]

    def __call__(self, text: str | list[str], return_tensors: str | None = None,
                 padding: bool = False, add_special_tokens: bool = True,
                 padding_side: str | None = None, **_: Any) -> dict[str, Any]:
        """{"input_ids": ..., "attention_mask": ...} of one text or several, as lists (or
        tensors with return_tensors="pt", which needs equal lengths or `padding`)."""
        texts = [text] if isinstance(text, str) else text
        rows = [self.encode(t, add_special_tokens) for t in check_texts(texts)]
        if return_tensors is None and not padding:
            masks = [[1] * len(row) for row in rows]
            return {"input_ids": rows[0] if isinstance(text, str) else rows,
                    "attention_mask": masks[0] if isinstance(text, str) else masks}
        if return_tensors not in (None, "pt"):
            raise InputError(f"return_tensors must be 'pt' or None, got {return_tensors!r}")
        ids, mask = padded(rows, self.pad_token_id, padding_side or self.padding_side)
        if return_tensors is None:
            return {"input_ids": ids.tolist(), "attention_mask": mask.tolist()}
        return {"input_ids": ids, "attention_mask": mask}

    def __repr__(self) -> str:
        return (f"LensTokenizer({self.inner.kind}, {len(self)} tokens, bos_token_id="
                f"{self.bos_token_id})")


def check_texts(texts: object) -> list[str]:
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
        raise InputError(f"text input is a string or a non-empty list of strings, got "
                         f"{texts!r:.60}")
    return texts


def padded(rows: list[list[int]], pad_id: int | None,
           side: str) -> tuple[Tensor, Tensor]:
    """Rows of ids -> (ids (B, T), mask (B, T), 1 on real tokens), padded on `side` to the
    longest row with `pad_id`."""
    if side not in PADDING_SIDES:
        raise InputError(f"padding_side must be 'right' or 'left', got {side!r}")
    longest = max(len(row) for row in rows)
    if longest == 0:
        raise InputError("the text has no tokens: give at least one character")
    if pad_id is None and any(len(row) != longest for row in rows):
        raise InputError("texts of different lengths need a padding token, and this tokenizer "
                         "has none (no end-of-text or BOS token): give texts of one length, "
                         "or token ids")
    ids = torch.full((len(rows), longest), 0 if pad_id is None else pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), longest), dtype=torch.long)
    for i, row in enumerate(rows):
        at = slice(0, len(row)) if side == "right" else slice(longest - len(row), longest)
        ids[i, at] = torch.tensor(row, dtype=torch.long)
        mask[i, at] = 1
    return ids, mask  # (B, T), (B, T)


class LensTokenMethods:
    """TransformerLens's tokenisation methods, for a class with `tokenizer` (a LensTokenizer or
    None), `cfg` (default_prepend_bos, n_ctx, device)."""

    tokenizer: LensTokenizer | None
    cfg: Any

    def _lens_tokenizer(self) -> LensTokenizer:
        if self.tokenizer is None:
            raise InputError("this HookedGPT has no tokenizer: give token ids, or build it with "
                             "HookedGPT(model, tokenizer) / HookedGPT.from_run(run_dir)")
        return self.tokenizer

    def _bos_wanted(self, prepend_bos: bool | None) -> list[int]:
        prepend = self.cfg.default_prepend_bos if prepend_bos is None else prepend_bos
        if not isinstance(prepend, bool):
            raise InputError(f"prepend_bos must be True, False or None, got {prepend_bos!r:.40}")
        if not prepend:
            return []
        bos = self._lens_tokenizer().bos_token_id
        if bos is None:
            raise InputError("this tokenizer has no BOS token (no begin-of-sequence or "
                             "<|endoftext|> token: a character tokenizer, say): pass "
                             "prepend_bos=False")
        return [bos]

    def tokens_and_mask(self, input: str | list[str], prepend_bos: bool | None = None,
                        padding_side: str | None = None,
                        truncate: bool = True) -> tuple[Tensor, Tensor]:
        """Texts -> (ids (B, T), mask (B, T)) on the CPU: each text's tokens after BOS (where
        wanted), cut to n_ctx (with `truncate`), padded to one length."""
        tokenizer = self._lens_tokenizer()
        texts = check_texts([input] if isinstance(input, str) else input)
        bos = self._bos_wanted(prepend_bos)
        rows = [bos + tokenizer.inner.encode(text) for text in texts]
        if truncate:
            rows = [row[:self.cfg.n_ctx] for row in rows]
        return padded(rows, tokenizer.pad_token_id, padding_side or tokenizer.padding_side)

    def to_tokens(self, input: str | list[str], prepend_bos: bool | None = None,
                  padding_side: str | None = None, move_to_device: bool = True,
                  truncate: bool = True) -> Tensor:
        """A text or texts -> token ids (B, T), BOS first unless prepend_bos=False (default:
        cfg.default_prepend_bos), padded with the padding token on `padding_side`."""
        ids, _ = self.tokens_and_mask(input, prepend_bos, padding_side, truncate)
        return ids.to(self.cfg.device) if move_to_device else ids

    def to_string(self, tokens: Any) -> str | list[str]:
        """Token ids (T,) -> text; (B, T) -> one text a row."""
        tokenizer = self._lens_tokenizer()
        if isinstance(tokens, Tensor) and tokens.dim() == 2:
            return tokenizer.batch_decode(tokens)
        if isinstance(tokens, Tensor) and tokens.dim() > 2:
            raise InputError(f"to_string takes ids (T,) or (B, T), got {tuple(tokens.shape)}")
        return tokenizer.decode(tokens)

    def to_str_tokens(self, input: Any, prepend_bos: bool | None = None,
                      padding_side: str | None = None) -> list[str] | list[list[str]]:
        """Each token as its text: of a string (tokenised first), of ids (T,) or (1, T), or of
        each item of a list of either."""
        tokenizer = self._lens_tokenizer()
        if isinstance(input, list) and input and not isinstance(input[0], int):
            return [self.to_str_tokens(item, prepend_bos, padding_side) for item in input]
        if isinstance(input, str):
            input = self.to_tokens(input, prepend_bos, padding_side, move_to_device=False)[0]
        if isinstance(input, Tensor) and input.squeeze().dim() > 1:
            raise InputError(f"to_str_tokens takes the ids of one text, (T,) or (1, T), got "
                             f"{tuple(input.shape)}: index the batch first")
        return [tokenizer.inner.decode([token]) for token in as_id_list(input)]

    def to_single_token(self, string: str) -> int:
        """The id of a string that is one token (no BOS); InputError when it is more."""
        ids = self._lens_tokenizer().inner.encode(string) if isinstance(string, str) else None
        if ids is None or len(ids) != 1:
            count = "not a string" if ids is None else f"{len(ids)} tokens"
            raise InputError(f"{string!r:.40} is not a single token ({count})")
        return ids[0]

    def to_single_str_token(self, int_token: int) -> str:
        return self._lens_tokenizer().decode([int_token])

    def get_token_position(self, single_token: str | int | Tensor, input: str | Tensor,
                           mode: str = "first", prepend_bos: bool | None = None,
                           padding_side: str | None = None) -> int:
        """Where `single_token` (its id, or a string of one token) stands in `input` (a text,
        or ids (T,) / (1, T)): its first or last position (`mode`)."""
        if mode not in ("first", "last"):
            raise InputError(f"mode must be 'first' or 'last', got {mode!r:.40}")
        tokens = self.to_tokens(input, prepend_bos, padding_side, move_to_device=False)[0] \
            if isinstance(input, str) else input
        ids = as_id_list(tokens, "input")
        if isinstance(single_token, str):
            single_token = self.to_single_token(single_token)
        token_ids = as_id_list(single_token, "single_token")
        if len(token_ids) != 1:
            raise InputError(f"single_token must be one token, got {len(token_ids)}")
        token = token_ids[0]
        where = [i for i, t in enumerate(ids) if t == token]
        if not where:
            raise InputError(f"token {token} does not occur in the input")
        return where[0] if mode == "first" else where[-1]
