"""What counts as no text (``retrieval.text.blank``): what a BERT tokenizer's cleaning drops, and nothing more."""

from __future__ import annotations

import re
import sys
import unicodedata

import pytest

from retrieval.text import blank, visible_pattern


@pytest.mark.parametrize("text", ["", "   ", "\t\n", "\x00", "\u200b\u200d", "\ufeff \u00ad", "\ue000", "\ufffd"])
def test_blank_texts(text: str) -> None:
    assert blank(text)


@pytest.mark.parametrize(
    "text",
    [
        "a",
        " \u200bword",
        "42",
        "中文",
        "ไทย",
        "नमस्ते",
        "👨\u200d👩\u200d👧",
        # an emoji of Unicode 15: unassigned in Python 3.11's tables, yet the tokenizer reads it ([UNK]); it was
        # refused as empty
        "\U0001fa77",
        "\U00031350",  # CJK Extension H (Unicode 15)
    ],
)
def test_texts_that_are_not_blank(text: str) -> None:
    assert not blank(text)


def test_the_specs_pattern_finds_exactly_the_texts_that_are_not_blank() -> None:
    """The OpenAPI spec states `visible_pattern` as every query text's pattern: a client validating against it must
    refuse exactly what the server refuses as empty. Checked on every code point alone (the pattern is one
    character class) and on mixed texts."""
    pattern = re.compile(visible_pattern())
    disagree = [
        hex(code)
        for code in range(sys.maxunicode + 1)
        if unicodedata.category(chr(code)) != "Cs" and bool(pattern.search(chr(code))) == blank(chr(code))
    ]
    assert disagree == []
    for text in ["", " \u200b ", "\ue000\ufffd", "a\u200b", " \U00100000 x", "\U0001fa77", "\x00\t"]:
        assert bool(pattern.search(text)) == (not blank(text)), repr(text)
