"""What counts as text: a query or a document that says nothing is refused (or skipped) before it is encoded."""

from __future__ import annotations

import functools
import sys
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


@functools.cache
def visible_pattern() -> str:
    """A regular expression that finds a character ``blank`` does not drop: a text is searchable exactly when it
    matches (``re.search``). The server's OpenAPI spec states it as the texts' ``pattern``, so a client that
    checks its requests against the spec refuses what the server would refuse; built from the same Unicode tables
    as ``blank``, so the two cannot disagree."""
    ranges: list[tuple[int, int]] = []
    for code in range(sys.maxunicode + 1):
        if 0xD800 <= code <= 0xDFFF:  # surrogates: no valid text holds one alone (refused as such), and a range
            continue  # over them is not a valid class for many regex engines (ECMA-262's among them)
        c = chr(code)
        if c == INVISIBLE or unicodedata.category(c) in DROPPED:
            if ranges and ranges[-1][1] == code - 1:
                ranges[-1] = (ranges[-1][0], code)
            else:
                ranges.append((code, code))

    def escape(code: int) -> str:
        return f"\\u{code:04x}" if code <= 0xFFFF else chr(code)  # astral: the character itself (one code point)

    body = "".join(escape(a) if a == b else f"{escape(a)}-{escape(b)}" for a, b in ranges)
    return f"[^\\s{body}]"
