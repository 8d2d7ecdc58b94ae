"""The English RAG corpus for the real-model demo and the quality benchmark (issue #17).

Three hand-written sets of short documents about invented entities (towns, people, companies, rivers,
ships...), so a model must read the documents to answer instead of recalling facts it was trained on.
``tune`` (32 documents, 64 questions) is for tuning the system; ``eval`` (64 documents, 128 questions) is
held out and used only to report. ``heldout`` (144 documents in 18 kinds and many styles: news items, museum
labels, letters, notices, minutes...; 288 questions, issue #24) is large enough for paired confidence
intervals, and shares no entity, title or answer with the other two or with the synthetic corpus
(kvboost_rag.app.synth_corpus); nothing may be trained or tuned on it. Within a set, entities come in
small confusable groups of one ``kind`` (four towns on different rivers, founded in nearby years...), so
distractor documents matter; no gold answer appears in any other document of its set.

Stdlib only: the benchmark imports this before it loads torch or a model.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from importlib import resources
from typing import Any

SPLITS = ("tune", "eval", "heldout", "dev", "test", "dev2", "test2")
# Test splits: read once, by a final benchmark, never by a trainer or a choice. "test" was read for #32's first
# final adapter (2026-12-04); dev2/test2 (768 and 1,792 questions, written after it) resolve about 1.5 points.
READ_ONCE = frozenset({"test", "test2"})
_PACKAGE = "kvboost_rag.app"
_DIR = ("assets", "rag_corpus")
# how many distractors of the gold document's kind retrieval_sets takes first (when the set has them)
SAME_KIND_DISTRACTORS = 2


@dataclass(frozen=True, slots=True)
class CorpusDoc:
    id: str
    title: str
    text: str
    kind: str = ""  # entity type ("town", "ship"...): distractors of the same kind are the confusable ones


@dataclass(frozen=True, slots=True)
class CorpusQuestion:
    id: str
    doc_id: str  # the gold document
    question: str
    answer: str  # appears verbatim in the gold document and in no other document of its set
    aliases: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class RagCorpus:
    documents: tuple[CorpusDoc, ...]
    questions: tuple[CorpusQuestion, ...]

    def doc(self, doc_id: str) -> CorpusDoc:
        for d in self.documents:
            if d.id == doc_id:
                return d
        raise KeyError(doc_id)


def _str(obj: dict[str, Any], key: str, where: str) -> str:
    value = obj.get(key)
    if not isinstance(value, str) or not value:
        raise ValueError(f"{where}: field {key!r} must be a non-empty string")
    return value


def parse(data: Any, split: str) -> RagCorpus:
    """A corpus from its JSON object (version 1); ``split`` names it in errors."""
    if not isinstance(data, dict) or data.get("version") != 1:
        raise ValueError(f"rag corpus {split!r}: expected an object with version 1")
    docs = tuple(
        CorpusDoc(_str(d, "id", split), _str(d, "title", split), _str(d, "text", split), str(d.get("kind", "")))
        for d in data.get("documents", [])
    )
    questions = tuple(
        CorpusQuestion(
            _str(q, "id", split), _str(q, "doc_id", split), _str(q, "question", split), _str(q, "answer", split),
            tuple(str(a) for a in q.get("aliases", [])),
        )
        for q in data.get("questions", [])
    )
    ids = {d.id for d in docs}
    if len(ids) != len(docs):
        raise ValueError(f"rag corpus {split!r}: duplicate document ids")
    for q in questions:
        if q.doc_id not in ids:
            raise ValueError(f"rag corpus {split!r}: question {q.id} names unknown document {q.doc_id}")
    return RagCorpus(docs, questions)


def load_corpus(split: str) -> RagCorpus:
    """Load the ``"tune"``, ``"eval"`` or ``"heldout"`` set from the package data."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    path = resources.files(_PACKAGE).joinpath(*_DIR, f"{split}.json")
    return parse(json.loads(path.read_text(encoding="utf-8")), split)


def split_exists(split: str) -> bool:
    """Whether the package holds ``split`` (the dev and test splits of issue #32 may be absent in a checkout)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    return resources.files(_PACKAGE).joinpath(*_DIR, f"{split}.json").is_file()


def questions_by_doc(corpus: RagCorpus) -> dict[str, list[CorpusQuestion]]:
    """Each document's questions, by document id (documents without a question are absent)."""
    out: dict[str, list[CorpusQuestion]] = {}
    for q in corpus.questions:
        out.setdefault(q.doc_id, []).append(q)
    return out


def doc_text(doc: CorpusDoc) -> str:
    """The document as it is put into prompts: title line, then the text."""
    return f"{doc.title}\n{doc.text}"


_EDGE_PUNCT = " \t\n\"'`.,;:!?()[]{}*_-"


def _normalize(s: str) -> str:
    s = " ".join(s.split()).lower().strip(_EDGE_PUNCT)
    # thousands separators: "3900" and "3,900" name the same number
    return re.sub(r"(?<=\d),(?=\d{3})", "", s)


def is_correct(answer_text: str, q: CorpusQuestion) -> bool:
    """Whether a generated answer contains the gold answer or one of its aliases (case-insensitive,
    whitespace-normalized, edge punctuation stripped, thousands separators ignored; a number must match a
    whole number, so "1714" does not count for "14")."""
    if not isinstance(answer_text, str):
        raise TypeError(f"answer_text must be a str, got {type(answer_text).__name__}")
    got = _normalize(answer_text)
    return any(_found(g, got) for g in (_normalize(s) for s in (q.answer, *q.aliases)))


def _found(gold: str, got: str) -> bool:
    # a substring, except that a number must not run on into more digits ("3900" is not in "39000")
    if not gold:
        return False
    head = r"(?<!\d)" if gold[0].isdigit() else ""
    tail = r"(?!\d)" if gold[-1].isdigit() else ""
    return re.search(head + re.escape(gold) + tail, got) is not None


def retrieval_sets(corpus: RagCorpus, k: int, seed: int) -> list[tuple[CorpusQuestion, list[CorpusDoc]]]:
    """For each question, k documents: its gold document and k-1 distractors, shuffled.

    Deterministic in (corpus, k, seed): question i draws from ``random.Random(seed + i)``. At least
    ``SAME_KIND_DISTRACTORS`` distractors share the gold document's kind (when the set has that many), the
    confusable ones a real retriever would also return; the rest are drawn from the other documents."""
    if isinstance(k, bool) or not isinstance(k, int):
        raise TypeError(f"k must be an int, got {type(k).__name__}")
    if not 1 <= k <= len(corpus.documents):
        raise ValueError(f"k must be in 1..{len(corpus.documents)}, got {k}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    by_id = {d.id: d for d in corpus.documents}
    out: list[tuple[CorpusQuestion, list[CorpusDoc]]] = []
    for i, q in enumerate(corpus.questions):
        rng = random.Random(seed + i)
        gold = by_id[q.doc_id]
        others = [d for d in corpus.documents if d.id != gold.id]
        same = [d for d in others if gold.kind and d.kind == gold.kind]
        picked = rng.sample(same, min(SAME_KIND_DISTRACTORS, len(same), k - 1))
        rest = [d for d in others if d not in picked]
        picked += rng.sample(rest, k - 1 - len(picked))
        docs = [gold, *picked]
        rng.shuffle(docs)
        out.append((q, docs))
    return out
