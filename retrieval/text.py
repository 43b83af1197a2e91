"""What counts as text: a query or a document that says nothing is refused (or skipped) before it is encoded."""

from __future__ import annotations

import unicodedata

INVISIBLE = "\ufffd"  # dropped by BERT-style tokenizers, with every control and format character


def blank(text: str) -> bool:
    """True for a text with nothing to encode: whitespace, or characters the tokenizer drops (NUL and other
    controls, zero-width spaces and joiners, BOMs, U+FFFD). Such a text encodes exactly as "" does, and matched
    every other such text at score 1.0. Costs one character's look-up for a text that starts with a letter."""
    return all(c.isspace() or c == INVISIBLE or unicodedata.category(c)[0] == "C" for c in text.strip())


def valid_unicode(text: str) -> bool:
    """False for a string with a lone surrogate (JSON's "\\ud800", or a byte Python could not decode): it has no
    UTF-8 form, and the tokenizer would fail on it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
