"""Pseudo-queries: a labelled retrieval task made from an unlabelled corpus, for choosing a transform without qrels.

Each sampled document gives one query and is its one relevant document; the ``kind`` says how (``KINDS``):

- "sentence": one of its sentences is the query, and the document without it (to be re-encoded, so the query's
  own words are not in the vector it must find) the positive (the inverse cloze task of Lee et al. 2019).
  Documents whose rest keeps at least MIN_REST words come first; only when there are too few of them are shorter
  ones cut in two at a word boundary (the first part the query, the rest the positive), as a corpus of single
  sentences must be.
- "keywords": a bag of its rarest words (KEYWORDS of them, by document frequency in the documents read, each
  found in at least one other document) is the query; the document as indexed is the positive (no re-encoding).
  It stands for short keyword queries that share words with their documents but none of their style.
- "half": the first half of its words is the query, the second half the positive: a long query with the
  document's style but little of its wording.

A sentence shares words and style with the rest of its document and real questions do not, so one kind alone
rewards transforms that real queries cannot use; ``tune --auto`` asks a change to win on every kind. Everything
is seeded: the same corpus, kind and seed give the same task, and each kind samples its own documents.
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
KINDS = ("sentence", "keywords", "half")
KEYWORDS = 5  # words of a keyword query
MIN_KEYWORD_DOCS = 500  # "keywords" reads at least this many documents for its document frequencies
WORD = re.compile(r"[^\W\d_][\w'-]*[^\W_]")  # a word of 2+ characters starting with a letter
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
    positives: list[str] | None  # None: each document as indexed is its own positive ("keywords")
    split_by: list[str]  # "sentence", "words", "keywords" or "half", per query

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


def split_half(text: str, min_words: int = MIN_WORDS) -> tuple[str, str, str] | None:
    """(first half of the words, second half, "half"), or None for a text of fewer than MIN_REST + MIN_WORDS
    words (a half too short to stand for a document)."""
    words = text.split()
    if len(words) < max(MIN_REST + min_words, 2 * min_words):
        return None
    cut = len(words) // 2
    return " ".join(words[:cut]), " ".join(words[cut:]), "half"


def words_of(text: str) -> list[str]:
    """The distinct lower-cased words of ``text``, in order of first appearance."""
    return list(dict.fromkeys(w.lower() for w in WORD.findall(text)))


def keyword_query(text: str, df: dict[str, int], n: int = KEYWORDS) -> str | None:
    """The ``n`` rarest words of ``text`` by ``df`` (ties: first seen first) found in at least one other document
    (a word only this document has would give its answer away), in the text's order; None if it has fewer."""
    words = [w for w in words_of(text) if df.get(w, 0) >= 2]
    if len(words) < n:
        return None
    rarest = set(sorted(words, key=lambda w: df[w])[:n])  # stable: equal counts keep the text's order
    return " ".join(w for w in words if w in rarest)


def make_pseudo_queries(
    n_docs: int,
    texts: Callable[[Sequence[int]], list[str]],
    ids: Callable[[int], str],
    n: int = 300,
    seed: int = 0,
    min_words: int = MIN_WORDS,
    kind: str = "sentence",
) -> PseudoQueries:
    """Up to ``n`` pseudo-queries of ``kind`` (``KINDS``) from a corpus of ``n_docs`` rows, read through
    ``texts(rows)`` and ``ids(row)``.

    Rows are visited in a seeded random order (its own for each kind), a batch at a time, until ``n`` documents
    gave a query (so a large corpus is never read whole); "sentence": cuts in two fill up what is missing; rows
    too short are passed over."""
    if kind not in KINDS:
        raise ValueError(f"unknown pseudo-query kind {kind!r}; choose one of {', '.join(KINDS)}")
    if kind == "sentence":  # the draws of the original single kind, unchanged
        rng = np.random.default_rng(seed)
    else:
        rng = np.random.default_rng([seed, KINDS.index(kind)])
    order = rng.permutation(n_docs)
    if kind != "sentence":
        return _other_kind(kind, order, texts, ids, n, min_words)
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


def _other_kind(
    kind: str,
    order: np.ndarray,
    texts: Callable[[Sequence[int]], list[str]],
    ids: Callable[[int], str],
    n: int,
    min_words: int,
) -> PseudoQueries:
    """ "keywords" or "half" over the rows in ``order``; "keywords" reads the first max(2 n, MIN_KEYWORD_DOCS) of
    them whole for its document frequencies, then takes its queries from them."""
    chosen: list[tuple[int, str, str]] = []  # (row, query, positive)
    batch = max(2 * n, 64) if kind == "half" else max(2 * n, MIN_KEYWORD_DOCS)
    for start in range(0, len(order), batch):
        chunk = [int(r) for r in order[start : start + batch]]
        read = texts(chunk)
        if kind == "keywords":
            df: dict[str, int] = {}
            for text in read:
                for word in words_of(text):
                    df[word] = df.get(word, 0) + 1
            for row, text in zip(chunk, read, strict=True):
                query = keyword_query(text, df)
                if query is not None and len(chosen) < n:
                    chosen.append((row, query, text))
            break  # the frequencies are those of this sample: its documents are the only candidates
        for row, text in zip(chunk, read, strict=True):
            split = split_half(text, min_words)
            if split is not None and len(chosen) < n:
                chosen.append((row, split[0], split[1]))
        if len(chosen) == n:
            break
    rows = [row for row, _, _ in chosen]
    query_ids = [f"pq{row}" for row in rows]
    qrels = {q: {ids(row): 1} for q, row in zip(query_ids, rows, strict=True)}
    positives = None if kind == "keywords" else [positive for _, _, positive in chosen]
    return PseudoQueries(Queries(query_ids, [q for _, q, _ in chosen]), qrels, rows, positives, [kind] * len(rows))
