"""What counts as no text (``retrieval.text.blank``): what a BERT tokenizer's cleaning drops, and nothing more."""

from __future__ import annotations

import pytest

from retrieval.text import blank


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
