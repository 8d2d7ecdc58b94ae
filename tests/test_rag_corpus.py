"""The English RAG corpus (kvboost_rag/app/assets/rag_corpus): shape, answerability and the loader's helpers."""

from __future__ import annotations

import re

import pytest

from kvboost_rag.app.rag_corpus import (
    SAME_KIND_DISTRACTORS,
    CorpusDoc,
    CorpusQuestion,
    RagCorpus,
    doc_text,
    is_correct,
    load_corpus,
    retrieval_sets,
)

COUNTS = {"tune": (32, 64), "eval": (64, 128)}
MIN_WORDS, MAX_WORDS = 90, 140


@pytest.fixture(scope="module", params=["tune", "eval"])
def split(request):
    return request.param


@pytest.fixture(scope="module")
def corpora() -> dict[str, RagCorpus]:
    return {s: load_corpus(s) for s in COUNTS}


def _contains(needle: str, hay: str) -> bool:
    """Whole-word, case-insensitive, thousands separators ignored ("300" is not found in "7,300")."""
    def norm(s: str) -> str:
        return re.sub(r"(?<=\d),(?=\d)", "", s.lower())

    return re.search(r"(?<!\w)" + re.escape(norm(needle)) + r"(?!\w)", norm(hay)) is not None


def _sentences(corpus: RagCorpus) -> set[str]:
    return {s.strip().lower() for d in corpus.documents for s in re.split(r"(?<=[.!?])\s+", d.text) if s.strip()}


def test_counts_and_unique_ids(corpora, split):
    c = corpora[split]
    n_docs, n_q = COUNTS[split]
    assert (len(c.documents), len(c.questions)) == (n_docs, n_q)
    assert len({d.id for d in c.documents}) == n_docs
    assert len({q.id for q in c.questions}) == n_q
    assert len({d.title for d in c.documents}) == n_docs
    per_doc = {d.id: 0 for d in c.documents}
    for q in c.questions:
        per_doc[q.doc_id] += 1
    assert set(per_doc.values()) == {2}


def test_document_lengths_and_kinds(corpora, split):
    c = corpora[split]
    for d in c.documents:
        assert MIN_WORDS <= len(d.text.split()) <= MAX_WORDS, d.id
        assert doc_text(d) == f"{d.title}\n{d.text}"
    kinds: dict[str, int] = {}
    for d in c.documents:
        assert d.kind, d.id
        kinds[d.kind] = kinds.get(d.kind, 0) + 1
    # retrieval_sets takes same-kind distractors, so every kind needs a group to draw them from
    assert min(kinds.values()) >= SAME_KIND_DISTRACTORS + 1


def test_answers_are_in_gold_doc_only(corpora, split):
    c = corpora[split]
    for q in c.questions:
        gold = c.doc(q.doc_id)
        assert gold.title.lower() in q.question.lower(), q.id  # the question names its entity
        assert 1 <= len(q.answer.split()) <= 3, q.id
        for s in (q.answer, *q.aliases):
            assert s in doc_text(gold), (q.id, s)  # verbatim
            others = [d.id for d in c.documents if d.id != gold.id and _contains(s, doc_text(d))]
            assert not others, (q.id, s, others)
    for d in c.documents:
        answers = [q.answer for q in c.questions if q.doc_id == d.id]
        assert len(set(answers)) == 2, d.id  # two questions on different facts


def test_sets_are_disjoint(corpora):
    tune, ev = corpora["tune"], corpora["eval"]
    assert not {d.id for d in tune.documents} & {d.id for d in ev.documents}
    assert not {q.id for q in tune.questions} & {q.id for q in ev.questions}
    assert not {d.title.lower() for d in tune.documents} & {d.title.lower() for d in ev.documents}
    assert not _sentences(tune) & _sentences(ev)
    # no entity of one set is named anywhere in the other
    for a, b in ((tune, ev), (ev, tune)):
        for d in a.documents:
            assert not any(_contains(d.title, doc_text(o)) for o in b.documents), d.title


def test_load_corpus_rejects_unknown_split():
    with pytest.raises(ValueError, match="split"):
        load_corpus("train")


def test_retrieval_sets(corpora, split):
    c = corpora[split]
    k = 12
    sets = retrieval_sets(c, k, seed=7)
    assert sets == retrieval_sets(c, k, seed=7)  # deterministic
    assert sets != retrieval_sets(c, k, seed=8)
    assert [q for q, _ in sets] == list(c.questions)
    positions = set()
    for q, docs in sets:
        ids = [d.id for d in docs]
        assert len(ids) == k and len(set(ids)) == k
        assert q.doc_id in ids
        positions.add(ids.index(q.doc_id))
        gold_kind = c.doc(q.doc_id).kind
        assert sum(d.kind == gold_kind for d in docs if d.id != q.doc_id) >= SAME_KIND_DISTRACTORS
    assert len(positions) > k // 2  # the gold document is not always in the same place


def test_retrieval_sets_edges(corpora):
    c = corpora["tune"]
    assert all([d.id for d in docs] == [q.doc_id] for q, docs in retrieval_sets(c, 1, seed=0))
    assert all(len(docs) == len(c.documents) for _, docs in retrieval_sets(c, len(c.documents), seed=0))
    for bad in (0, len(c.documents) + 1):
        with pytest.raises(ValueError, match="k"):
            retrieval_sets(c, bad, seed=0)
    with pytest.raises(TypeError, match="k"):
        retrieval_sets(c, 2.0, seed=0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="seed"):
        retrieval_sets(c, 2, seed="0")  # type: ignore[arg-type]


Q = CorpusQuestion("x", "d", "Who founded Vesk Shipping?", "Ilse Varga", ("Varga",))
Q_NUM = CorpusQuestion("y", "d", "How many people live in Dunmarrow?", "3,900")


@pytest.mark.parametrize(
    ("text", "q", "expected"),
    [
        ("Ilse Varga", Q, True),
        ("ilse   varga.", Q, True),
        ("It was founded by Ilse\nVarga in 1898.", Q, True),
        ("Varga", Q, True),  # alias
        ('"Varga"!', Q, True),
        ("Ilse", Q, False),
        ("Josef Amberly", Q, False),
        ("", Q, False),
        ("3,900", Q_NUM, True),
        ("About 3900 people.", Q_NUM, True),
        ("39,000", Q_NUM, False),
        ("3.900", Q_NUM, False),
        ("13,900", Q_NUM, False),
        ("3,900,000", Q_NUM, False),
        ("1714", CorpusQuestion("z", "d", "When?", "14"), False),
        ("14 steamers", CorpusQuestion("z", "d", "When?", "14"), True),
    ],
)
def test_is_correct(text, q, expected):
    assert is_correct(text, q) is expected


def test_is_correct_rejects_non_str():
    with pytest.raises(TypeError, match="answer_text"):
        is_correct(None, Q)  # type: ignore[arg-type]


def test_dataclasses_are_frozen():
    d = CorpusDoc("a", "T", "text", "town")
    with pytest.raises(AttributeError):
        d.title = "U"  # type: ignore[misc]
