"""What counts as text: a query or a document that says nothing is refused (or skipped) before it is encoded."""

from __future__ import annotations

import unicodedata

INVISIBLE = "\ufffd"  # dropped by BERT-style tokenizers, with control, format and private-use characters
DROPPED = frozenset(("Cc", "Cf", "Cs", "Co"))  # not Cn: a character newer than Python's Unicode tables (an emoji
# of Unicode 15 under Python 3.11) is unassigned here, yet a tokenizer reads it ([UNK] at least)


def blank(text: str) -> bool:
    """True for a text with nothing to encode: whitespace, or characters a BERT tokenizer's cleaning drops (NUL
    and other controls, zero-width spaces and joiners, BOMs, private use, U+FFFD). Such a text encodes exactly
    as "" does, and matched every other such text at score 1.0."""
    if text[:1].isalnum():  # nearly every text: decided by its first character
        return False
    return all(c.isspace() or c == INVISIBLE or unicodedata.category(c) in DROPPED for c in text)


def valid_unicode(text: str) -> bool:
    """False for a string with a lone surrogate (JSON's "\\ud800", or a byte Python could not decode): it has no
    UTF-8 form, and the tokenizer would fail on it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
