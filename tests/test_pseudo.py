"""Pseudo-queries from an unlabelled corpus: sentence splitting, one text split into query and positive, and a
seeded, bounded sample of a corpus."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest

from retrieval.pseudo import (
    KINDS,
    MIN_REST,
    keyword_query,
    make_pseudo_queries,
    sentences,
    split_half,
    split_out,
    words_of,
)


def test_sentences_split_at_sentence_ends_only() -> None:
    text = 'Vitamin D matters. It was measured in 2010! Does it help? yes, e.g. in bones. (A note.) "Quoted."'
    assert sentences(text) == [
        "Vitamin D matters.",
        "It was measured in 2010!",
        "Does it help? yes, e.g. in bones.",  # a lower-case word does not start a sentence
        "(A note.)",
        '"Quoted."',
    ]
    assert sentences("  one sentence without an end  ") == ["one sentence without an end"]
    assert sentences("argparse.ArgumentParser parses. Arguments follow.") == [
        "argparse.ArgumentParser parses.",  # a dotted name is not a sentence end
        "Arguments follow.",
    ]


def test_split_out_takes_one_sentence_out_and_keeps_the_rest() -> None:
    text = "The first sentence is here. A second one follows it. Tiny. The last sentence ends the text."
    seen = set()
    for seed in range(20):
        query, rest, how = split_out(text, np.random.default_rng(seed))  # type: ignore[misc]
        assert how == "sentence" and query in sentences(text) and query != "Tiny."  # too short to be a query
        assert rest == " ".join(s for s in sentences(text) if s != query) and query not in rest
        assert len(rest.split()) >= MIN_REST
        seen.add(query)
    assert len(seen) == 3  # every eligible sentence gets its turn
    assert split_out(text, np.random.default_rng(5)) == split_out(text, np.random.default_rng(5))  # seeded


def test_split_out_cuts_a_single_sentence_in_two_or_gives_up() -> None:
    words = "one two three four five six seven eight nine ten".split()
    query, rest, how = split_out(" ".join(words), np.random.default_rng(0))  # type: ignore[misc]
    assert how == "words" and f"{query} {rest}".split() == words
    assert len(query.split()) >= 4 and len(rest.split()) >= 4
    assert split_out("only seven words in this short text", np.random.default_rng(0)) is None
    assert split_out("Short one. This one is much longer.", np.random.default_rng(0)) is None  # 7 words
    # three sentences, but taking one out would leave fewer than MIN_REST words: cut in two instead
    query, rest, how = split_out("A b. This sentence has some words. C d e f g.", np.random.default_rng(0))  # type: ignore[misc]
    assert how == "words" and len(f"{query} {rest}".split()) == 12


def corpus(n: int) -> list[str]:
    return [
        f"Document {i} has a first sentence about topic {i % 5} and more. It also has a second sentence, number {i}."
        if i % 3
        else f"short text {i}"  # every third row is too short to split
        for i in range(n)
    ]


def test_make_pseudo_queries_samples_a_seeded_bounded_set() -> None:
    texts = corpus(1000)
    requested: list[int] = []

    def read(rows: Sequence[int]) -> list[str]:
        requested.append(len(rows))
        return [texts[r] for r in rows]

    pseudo = make_pseudo_queries(len(texts), read, lambda r: f"doc{r}", n=30, seed=1)
    assert len(pseudo) == 30 == len(set(pseudo.rows))
    assert all(r % 3 for r in pseudo.rows)  # only rows that can be split
    assert max(requested) == 64 and sum(requested) < len(texts)  # read a batch at a time, never all of it
    assert pseudo.queries.ids == [f"pq{r}" for r in pseudo.rows]
    assert pseudo.qrels == {f"pq{r}": {f"doc{r}": 1} for r in pseudo.rows}
    for row, query, positive in zip(pseudo.rows, pseudo.queries.texts, pseudo.positives, strict=True):
        assert query in texts[row] and query not in positive
        assert sorted(f"{query} {positive}".split()) == sorted(texts[row].split())
    assert set(pseudo.split_by) == {"sentence"}
    again = make_pseudo_queries(len(texts), read, lambda r: f"doc{r}", n=30, seed=1)
    assert (again.rows, again.queries, again.positives) == (pseudo.rows, pseudo.queries, pseudo.positives)
    other = make_pseudo_queries(len(texts), read, lambda r: f"doc{r}", n=30, seed=2)
    assert other.rows != pseudo.rows


def test_make_pseudo_queries_returns_what_a_small_corpus_has() -> None:
    texts = corpus(12)  # 8 rows can be split
    pseudo = make_pseudo_queries(len(texts), lambda rows: [texts[r] for r in rows], str, n=300)
    assert sorted(pseudo.rows) == [r for r in range(12) if r % 3]


def test_sentences_come_first_and_cuts_in_two_fill_up() -> None:
    one = "a single sentence of exactly nine words in it"  # can only be cut in two
    texts = [one] * 50 + corpus(12)  # 8 documents of two sentences, after 50 that can only be cut
    read = lambda rows: [texts[r] for r in rows]  # noqa: E731
    few = make_pseudo_queries(len(texts), read, str, n=5, seed=0)
    assert few.split_by == ["sentence"] * 5 and all(r >= 50 for r in few.rows)
    more = make_pseudo_queries(len(texts), read, str, n=20, seed=0)
    assert more.split_by == ["sentence"] * 8 + ["words"] * 12 and len(set(more.rows)) == 20


def test_split_out_bounds_are_inclusive() -> None:
    """A sentence of exactly MIN_WORDS words is a query, a rest of exactly MIN_REST words a positive, and a cut
    in two may leave exactly MIN_WORDS words on either side."""
    query = "Four words right here."  # 4 words
    rest = " ".join(["Filler"] + ["word"] * (MIN_REST - 2) + ["end."])  # MIN_REST words
    for seed in range(5):
        assert split_out(f"{query} {rest}", np.random.default_rng(seed)) == (query, rest, "sentence")
    words = "one two three four five six seven eight"  # 2 * MIN_WORDS: the only cut is in the middle
    assert split_out(words, np.random.default_rng(0)) == ("one two three four", "five six seven eight", "words")


def test_keyword_queries_are_each_documents_rarest_shared_words() -> None:
    texts = [
        "Alpha beta gamma delta epsilon zeta eta theta common words here.",
        "Alpha beta gamma delta epsilon common words here and more.",
        "Alpha beta gamma common words here, zeta eta theta again.",
        "Alpha common words here only, with nothing rare.",
    ]
    df = {w: sum(w in words_of(t) for t in texts) for t in texts for w in words_of(t)}
    # the five rarest words found in at least one other document, in the text's order; "iota" is in no other
    assert keyword_query(texts[0] + " iota", df) == "delta epsilon zeta eta theta"
    assert keyword_query(texts[3], df) is None  # fewer than five words any other document has
    pseudo = make_pseudo_queries(len(texts), lambda rows: [texts[r] for r in rows], str, n=10, kind="keywords")
    assert pseudo.positives is None  # the documents as indexed are the positives: nothing to re-encode
    assert sorted(pseudo.rows) == [0, 1, 2] and set(pseudo.split_by) == {"keywords"}
    for row, query in zip(pseudo.rows, pseudo.queries.texts, strict=True):
        assert len(query.split()) == 5 and set(query.split()) <= set(words_of(texts[row]))


def test_half_queries_cut_each_document_in_the_middle() -> None:
    texts = corpus(200)
    pseudo = make_pseudo_queries(len(texts), lambda rows: [texts[r] for r in rows], str, n=30, seed=1, kind="half")
    assert len(pseudo) == 30 and set(pseudo.split_by) == {"half"} and pseudo.positives is not None
    for row, query, positive in zip(pseudo.rows, pseudo.queries.texts, pseudo.positives, strict=True):
        words = texts[row].split()
        assert query.split() == words[: len(words) // 2] and positive.split() == words[len(words) // 2 :]
    assert split_half("too few words to cut in two halves here") is None


def test_each_kind_samples_its_own_documents_seeded() -> None:
    texts = corpus(600)
    read = lambda rows: [texts[r] for r in rows]  # noqa: E731
    made = {kind: make_pseudo_queries(len(texts), read, str, n=40, seed=3, kind=kind) for kind in KINDS}
    assert made["sentence"].rows != made["half"].rows != made["keywords"].rows
    for kind in KINDS:
        again = make_pseudo_queries(len(texts), read, str, n=40, seed=3, kind=kind)
        assert (again.rows, again.queries) == (made[kind].rows, made[kind].queries)
    # the sentence kind draws what it always drew
    assert made["sentence"].rows == make_pseudo_queries(len(texts), read, str, n=40, seed=3).rows
    with pytest.raises(ValueError, match="unknown pseudo-query kind 'title'"):
        make_pseudo_queries(len(texts), read, str, kind="title")
