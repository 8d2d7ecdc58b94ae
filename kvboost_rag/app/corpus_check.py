"""What makes a hand-written RAG split usable for paired accuracy CIs, checked (issues #24, #32).

Each question has one answer that its gold document states verbatim and no other document of the split
contains; the split shares no id, title, answer, sentence or invented name with any other split or with the
corpora the adapters train on; it is not templated (question openings and document openings vary).

    python -m kvboost_rag.app.corpus_check FILE.json [--against OTHER.json ...] [--min-docs N --min-questions N]

prints one line per problem (exit 1) or ``ok`` (exit 0). ``tests/test_rag_splits.py`` runs the same checks on
every packaged split. Stdlib only (the synthetic-corpus grammar is imported from its module).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvboost_rag.app import rag_corpus as rc
from kvboost_rag.app import synth_corpus as sc

MIN_WORDS, MAX_WORDS = 70, 130  # short: a k=12 prompt stays near 1.5K tokens
MAX_ANSWER_WORDS = 4
# words of titles or answers that are ordinary English, not invented names ("River Quillet", "Horseshoe Race")
GENERIC = frozenset({"Canal", "Fare", "Lane", "Lower", "Race", "River", "Tower", "Wages", "Water", "Lake", "Mount",
                     "Bridge", "Castle", "Abbey", "Hall", "House", "Street", "Road", "Point", "North", "South",
                     "East", "West", "Upper", "Great", "Little", "Saint", "Old", "New", "Brass", "Bells"})
# at most this share of questions may open with the same three words once the entity's name is removed
MAX_OPENING_SHARE = 0.08


@dataclass(frozen=True, slots=True)
class Shape:
    """What a split must have: its size and how many kinds (confusable groups)."""

    min_docs: int = 1
    min_questions: int = 1
    min_kinds: int = 1
    questions_per_doc: int = 2


def norm(s: str) -> str:
    return re.sub(r"(?<=\d),(?=\d)", "", s.lower())


def contains(needle: str, hay: str) -> bool:
    """Whole-word, case-insensitive, thousands separators ignored ("300" is not found in "7,300")."""
    return _found(norm(needle), norm(hay))


def _texts(c: rc.RagCorpus) -> dict[str, str]:
    """Each document's text (title included), normalized once for the many lookups the checks make."""
    return {d.id: norm(rc.doc_text(d)) for d in c.documents}


def _found(needle: str, hay: str) -> bool:
    """:func:`contains` on normalized strings; a plain substring test first (most pairs share nothing)."""
    return needle in hay and re.search(r"(?<!\w)" + re.escape(needle) + r"(?!\w)", hay) is not None


def golds(q: rc.CorpusQuestion) -> tuple[str, ...]:
    return (q.answer, *q.aliases)


def _sentences(text: str) -> set[str]:
    return {s.strip().lower() for s in re.split(r"(?<=[.!?])\s+", text) if len(s.split()) >= 4}


def _synth_word() -> re.Pattern[str]:
    """Every name synth_corpus._Names.word() can produce: two onset+vowel syllables and an optional coda."""
    def alt(parts: tuple[str, ...]) -> str:
        return "|".join(sorted((p for p in parts if p), key=len, reverse=True))

    return re.compile(rf"(?:(?:{alt(sc._ONSETS)})(?:{alt(sc._VOWELS)})){{2}}(?:{alt(sc._CODAS)})?", re.I)


def check_shape(c: rc.RagCorpus, shape: Shape) -> list[str]:
    out: list[str] = []
    if len(c.documents) < shape.min_docs:
        out.append(f"{len(c.documents)} documents, want >= {shape.min_docs}")
    if len(c.questions) < shape.min_questions:
        out.append(f"{len(c.questions)} questions, want >= {shape.min_questions}")
    if len({q.id for q in c.questions}) != len(c.questions):
        out.append("duplicate question ids")
    if len({d.title.lower() for d in c.documents}) != len(c.documents):
        out.append("duplicate titles")
    per_doc = Counter(q.doc_id for q in c.questions)
    for d in c.documents:
        if per_doc.get(d.id, 0) != shape.questions_per_doc:
            out.append(f"{d.id}: {per_doc.get(d.id, 0)} questions, want {shape.questions_per_doc}")
        if not MIN_WORDS <= len(d.text.split()) <= MAX_WORDS:
            out.append(f"{d.id}: {len(d.text.split())} words, want {MIN_WORDS}-{MAX_WORDS}")
    kinds = Counter(d.kind for d in c.documents)
    if "" in kinds:
        out.append("a document without a kind")
    if len(kinds) < shape.min_kinds:
        out.append(f"{len(kinds)} kinds, want >= {shape.min_kinds}")
    for kind, n in kinds.items():  # confusable groups: enough members for retrieval_sets' same-kind distractors
        if n < rc.SAME_KIND_DISTRACTORS + 2:
            out.append(f"kind {kind!r} has {n} documents, want >= {rc.SAME_KIND_DISTRACTORS + 2}")
    return out


def check_answers(c: rc.RagCorpus) -> list[str]:
    out: list[str] = []
    texts = _texts(c)
    for q in c.questions:
        gold = c.doc(q.doc_id)
        if gold.title.lower() not in q.question.lower():
            out.append(f"{q.id}: the question does not name its document's title {gold.title!r}")
        if not 1 <= len(q.answer.split()) <= MAX_ANSWER_WORDS:
            out.append(f"{q.id}: answer of {len(q.answer.split())} words, want 1-{MAX_ANSWER_WORDS}")
        for s in golds(q):
            if s not in rc.doc_text(gold):
                out.append(f"{q.id}: {s!r} is not verbatim in {gold.id}")
            if contains(s, q.question):
                out.append(f"{q.id}: the question contains its answer {s!r}")
            needle = norm(s)
            clash = [d.id for d in c.documents if d.id != gold.id and _found(needle, texts[d.id])]
            if clash:
                out.append(f"{q.id}: {s!r} also in {clash}")
    for d in c.documents:
        answers = [q.answer.lower() for q in c.questions if q.doc_id == d.id]
        if len(set(answers)) != len(answers):
            out.append(f"{d.id}: two questions with the same answer")
        title = norm(d.title)
        named = [o.id for o in c.documents if o.id != d.id and _found(title, texts[o.id])]
        if named:
            out.append(f"{d.id}: its title {d.title!r} appears in {named}")
    return out


def check_not_templated(c: rc.RagCorpus) -> list[str]:
    out: list[str] = []
    openings: Counter[str] = Counter()
    for q in c.questions:
        title = c.doc(q.doc_id).title
        rest = re.sub(re.escape(title), "", q.question, flags=re.I).lower().split()
        openings[" ".join(rest[:3])] += 1
    limit = max(3, int(MAX_OPENING_SHARE * len(c.questions)))
    for opening, n in openings.items():
        if n > limit:
            out.append(f"{n} questions open with {opening!r} (at most {limit})")
    doc_openings = Counter(" ".join(d.text.split()[:3]).lower() for d in c.documents)
    for opening, n in doc_openings.items():
        if n > max(3, len(c.documents) // 20):
            out.append(f"{n} documents open with {opening!r}")
    return out


def check_disjoint(c: rc.RagCorpus, others: Iterable[rc.RagCorpus]) -> list[str]:
    """No id, title, answer or sentence shared with ``others``; no title of either named in the other."""
    out: list[str] = []
    own_text = _texts(c)
    for other in others:
        if {d.id for d in c.documents} & {d.id for d in other.documents}:
            out.append("document ids shared with another split")
        if {q.id for q in c.questions} & {q.id for q in other.questions}:
            out.append("question ids shared with another split")
        other_text = list(_texts(other).values())
        for d in c.documents:
            title = norm(d.title)
            if any(_found(title, t) for t in other_text):
                out.append(f"{d.id}: title {d.title!r} appears in another split")
        for o in other.documents:
            title = norm(o.title)
            hits = [d.id for d in c.documents if _found(title, own_text[d.id])]
            if hits:
                out.append(f"{hits}: name another split's title {o.title!r}")
        old_answers = {norm(s) for q in other.questions for s in golds(q)}
        for q in c.questions:
            if {norm(s) for s in golds(q)} & old_answers:
                out.append(f"{q.id}: its answer is another split's answer")
        old_sentences = set().union(*(_sentences(o.text) for o in other.documents))
        for d in c.documents:
            if _sentences(d.text) & old_sentences:
                out.append(f"{d.id}: a sentence shared with another split")
    return out


def check_not_synthetic(c: rc.RagCorpus, seeds: Sequence[int] = (0, 1, 2, 3, 4)) -> list[str]:
    """No name the synthetic training corpus could generate, nor any of its fixed values or first names."""
    out: list[str] = []
    word = _synth_word()
    values = {v.lower() for v in (*sc._GOODS, *sc._COLOURS, *sc._FOODS, *sc._MONTHS)}
    for d in c.documents:
        names = [d.title] + [s for q in c.questions if q.doc_id == d.id for s in golds(q)]
        for w in re.findall(r"[A-Z][a-z]+", " ".join(names)):
            if w not in GENERIC and 4 <= len(w) <= 11 and word.fullmatch(w):
                out.append(f"{d.id}: {w!r} is a name the synthetic corpus can generate")
        if set(re.findall(r"[A-Z][a-z]+", rc.doc_text(d))) & set(sc._FIRST):
            out.append(f"{d.id}: uses a first name of the synthetic corpus")
    for q in c.questions:
        if {s.lower() for s in golds(q)} & values:
            out.append(f"{q.id}: its answer is a synthetic-corpus value")
    texts = list(_texts(c).values())
    for seed in seeds:
        for s in sc.synthetic_corpus(240, seed).documents:
            name = s.title.split(" (")[0]
            needle = norm(name)
            if any(_found(needle, t) for t in texts):
                out.append(f"synthetic name {name!r} appears in the split")
    return out


def check_split(c: rc.RagCorpus, others: Iterable[rc.RagCorpus], shape: Shape = Shape()) -> list[str]:
    """Every problem found, one line each; empty when the split is usable."""
    return (check_shape(c, shape) + check_answers(c) + check_not_templated(c)
            + check_disjoint(c, list(others)) + check_not_synthetic(c))


def load_file(path: str) -> rc.RagCorpus:
    with open(path, encoding="utf-8") as f:
        return rc.parse(json.load(f), path)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvboost_rag.app.corpus_check", description=__doc__.split("\n")[0])
    ap.add_argument("file", help="the split to check (rag corpus JSON, version 1)")
    ap.add_argument("--against", nargs="*", default=[], help="more split files it must be disjoint from")
    ap.add_argument("--min-docs", type=int, default=1)
    ap.add_argument("--min-questions", type=int, default=1)
    ap.add_argument("--min-kinds", type=int, default=1)
    args = ap.parse_args(argv)
    c = load_file(args.file)
    others = [rc.load_corpus(s) for s in rc.SPLITS if rc.split_exists(s)]
    others = [o for o in others if o.documents[0].id not in {d.id for d in c.documents}]
    others += [load_file(p) for p in args.against]
    problems = check_split(c, others, Shape(args.min_docs, args.min_questions, args.min_kinds))
    for p in problems:
        print(p)
    print("ok" if not problems else f"{len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
