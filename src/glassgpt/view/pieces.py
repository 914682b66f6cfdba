"""Token pieces as the page shows them: what one token stands for, readable on its own.

A byte-level BPE token can hold part of a UTF-8 character (the first byte of "€", say); decoded
alone it is the replacement character `�`, or a box of a font that lacks the glyph. The page
shows such a byte as `<0xE2>` instead, and every whole character as itself.
"""

from __future__ import annotations

from functools import cache

from glassgpt.tokenizers import Tokenizer


@cache
def _byte_of_symbol() -> dict[str, int]:
    """Byte-level BPE writes each byte as one printable character: printable Latin-1 bytes as
    themselves, the others (controls, space, ...) as characters from U+0100 on, in order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    symbols = {chr(b): b for b in printable}
    others = [b for b in range(256) if b not in set(printable)]
    symbols.update({chr(256 + n): b for n, b in enumerate(others)})
    return symbols


def readable_bytes(raw: bytes) -> str:
    """Bytes as text: whole UTF-8 characters as themselves, a byte that is part of a character
    cut by the tokenizer as `<0xE2>` (never the replacement character or a tofu box)."""
    out, i = [], 0
    while i < len(raw):
        for n in (4, 3, 2, 1):  # the longest valid character starting at i
            try:
                out.append(raw[i:i + n].decode("utf-8"))
            except UnicodeDecodeError:
                continue
            i += n
            break
        else:
            out.append(f"<0x{raw[i]:02X}>")
            i += 1
    return "".join(out)


def piece_text(tokenizer: Tokenizer, token_id: int) -> str:
    """What one token stands for, readable on its own: a byte-level BPE piece that holds part
    of a UTF-8 character shows that byte as `<0xE2>`."""
    text = tokenizer.decode([token_id])
    if "\ufffd" not in text:
        return text
    inner = getattr(tokenizer, "tokenizer", None)  # the Hugging Face tokenizer of a BPE one
    symbol = inner.id_to_token(token_id) if hasattr(inner, "id_to_token") else None
    byte_of = _byte_of_symbol()
    if not symbol or any(ch not in byte_of for ch in symbol):
        return text.replace("\ufffd", "<?>")
    return readable_bytes(bytes(byte_of[ch] for ch in symbol))
