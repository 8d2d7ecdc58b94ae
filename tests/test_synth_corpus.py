"""kvboost_rag.app.synth_corpus: the templated training documents of ``kvboost-rag adapt --data synth|mix``."""

from __future__ import annotations

from collections import Counter

import pytest

from kvboost_rag.app import rag_corpus as rc
from kvboost_rag.app.synth_corpus import synthetic_corpus


def test_deterministic_in_seed_and_sized_as_asked():
    a, b, c = synthetic_corpus(60, 3), synthetic_corpus(60, 3), synthetic_corpus(60, 4)
    assert a == b
    assert a.documents != c.documents
    assert len(a.documents) == 60 and len({d.id for d in a.documents}) == 60
    assert len({d.kind for d in a.documents}) == 6


def test_every_answer_is_in_its_document_and_names_are_unique():
    corpus = synthetic_corpus(240, 0)
    titles = Counter(d.title for d in corpus.documents)
    assert max(titles.values()) == 1  # no two documents about the same entity
    for q in corpus.questions:
        assert q.answer in rc.doc_text(corpus.doc(q.doc_id)), q


def test_shares_no_entity_with_the_held_out_split():
    eval_titles = {d.title.split(" (")[0] for d in rc.load_corpus("eval").documents}
    synth_titles = {d.title.split(" (")[0] for d in synthetic_corpus(240, 0).documents}
    assert not eval_titles & synth_titles


def test_feeds_the_benchmark_s_retrieval_sets():
    corpus = synthetic_corpus(24, 1)
    sets = rc.retrieval_sets(corpus, 6, 0)
    assert len(sets) == len(corpus.questions)
    for q, docs in sets:
        assert len(docs) == 6 and q.doc_id in {d.id for d in docs}


@pytest.mark.parametrize("bad", [0, -1, True, 2.5])
def test_bad_size_is_refused(bad):
    with pytest.raises((ValueError, TypeError), match="n_docs"):
        synthetic_corpus(bad, 0)
