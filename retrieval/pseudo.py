"""Pseudo-queries: a labelled retrieval task made from an unlabelled corpus, for choosing a transform without qrels.

A sampled document gives up one of its sentences: that sentence is the query, and the document without it (to be
re-encoded, so the query's own words are not in the vector it must find) is the one relevant document (the
inverse cloze task of Lee et al. 2019). Documents whose rest keeps at least MIN_REST words come first; only when
there are too few of them are shorter ones cut in two at a word boundary (the first part the query, the rest
the positive), as a corpus of single sentences must be. Everything is seeded: the same corpus and seed give the
same task.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from retrieval.evaluate import Queries
from retrieval.metrics import Qrels

MIN_WORDS = 4  # a query of fewer words says too little to find anything
MIN_REST = 10  # a positive of fewer words has too little context left to be findable: a last resort
SENTENCE_END = re.compile(r"(?:(?<=[.!?])|(?<=[.!?][)\]\"']))\s+(?=[\"'(\[A-Z0-9])")


def sentences(text: str) -> list[str]:
    """The text's sentences: split after . ! or ? (and a closing bracket or quote) followed by a space and a capital,
    a digit or an opening mark."""
    return [s.strip() for s in SENTENCE_END.split(text.strip()) if s.strip()]


@dataclass(frozen=True)
class PseudoQueries:
    """``queries`` (ids ``pq<row>``) each with one relevant document, ``rows[i]``, whose vector is to be replaced
    by the encoding of ``positives[i]`` (the document without the query)."""

    queries: Queries
    qrels: Qrels
    rows: list[int]
    positives: list[str]
    split_by: list[str]  # "sentence" or "words", per query

    def __len__(self) -> int:
        return len(self.rows)


def split_out(text: str, rng: np.random.Generator, min_words: int = MIN_WORDS) -> tuple[str, str, str] | None:
    """(query, rest, how) for one text, or None when it is too short to give both a query and a positive. ``how``
    is "sentence" when a sentence came out and left at least MIN_REST words, else "words" (a cut in two)."""
    parts = sentences(text)
    total = len(text.split())
    eligible = [i for i, s in enumerate(parts) if min_words <= len(s.split()) <= total - MIN_REST]
    if len(parts) >= 2 and eligible:
        i = int(rng.choice(eligible))
        return parts[i], " ".join(parts[:i] + parts[i + 1 :]), "sentence"
    words = text.split()
    if len(words) >= 2 * min_words:
        cut = int(rng.integers(min_words, len(words) - min_words + 1))
        return " ".join(words[:cut]), " ".join(words[cut:]), "words"
    return None


def make_pseudo_queries(
    n_docs: int,
    texts: Callable[[Sequence[int]], list[str]],
    ids: Callable[[int], str],
    n: int = 300,
    seed: int = 0,
    min_words: int = MIN_WORDS,
) -> PseudoQueries:
    """Up to ``n`` pseudo-queries from a corpus of ``n_docs`` rows, read through ``texts(rows)`` and ``ids(row)``.

    Rows are visited in a seeded random order, a batch at a time, until ``n`` documents gave a sentence (so a
    large corpus is never read whole); cuts in two fill up what is missing; rows too short to split are passed
    over."""
    rng = np.random.default_rng(seed)
    order = rng.permutation(n_docs)
    found: list[tuple[int, tuple[str, str, str]]] = []
    cuts: list[tuple[int, tuple[str, str, str]]] = []
    batch = max(2 * n, 64)
    for start in range(0, n_docs, batch):
        chunk = [int(r) for r in order[start : start + batch]]
        for row, text in zip(chunk, texts(chunk), strict=True):
            split = split_out(text, rng, min_words)
            if split is not None and split[2] == "sentence":
                found.append((row, split))
            elif split is not None and len(cuts) < n:
                cuts.append((row, split))
            if len(found) == n:
                break
        if len(found) == n:
            break
    chosen = found + cuts[: n - len(found)]
    rows = [row for row, _ in chosen]
    queries, positives, how = ([split[i] for _, split in chosen] for i in range(3))
    query_ids = [f"pq{row}" for row in rows]
    qrels = {q: {ids(row): 1} for q, row in zip(query_ids, rows, strict=True)}
    return PseudoQueries(Queries(query_ids, queries), qrels, rows, positives, how)
