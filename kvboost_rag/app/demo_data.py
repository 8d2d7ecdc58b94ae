"""Synthetic RAG data for the embedded demo model: invented worlds, documents, questions, prompts.

The same code generates the training stream (``scripts/train_demo_model.py``), the bundled corpus and
held-out questions (``kvboost_rag/app/assets/demo_model``), and formats prompts for the CLI and the tests, so
the model is always asked questions in exactly the format it was trained on.

Why the model cannot answer from memory: every training sequence is a fresh random world (random names in
random relations), so no fact is ever stable across training and there is nothing to memorise; the only
way to lower the loss on an answer is to read it from the documents in the prompt. The bundled corpus is
one more world drawn with its own seed. ``scripts/train_demo_model.py`` measures the closed-book control
(the same questions with no documents) to show it.

Design choices that make in-context lookup learnable by a tiny model in CPU-minutes:
- entity names, relation words, years and jobs are single tokens (always after a space);
- documents are fact records, one fact per sentence, written "<subject> <relation> <value>." (a city:
  "Vasel country Stutam. Vasel river Oram."), so a value is the token after the two-token key
  (subject, relation);
- every question ends with its entity ("What is the country of Vasel?"), so the answer's first token is a copy
  from a fixed offset (asked mid-question, the entity was often miscopied: a first run wrote the wrong subject
  in most of its wrong answers);
- an answer first restates its key, then gives the value ("What is the country of Vasel?" -> "Vasel country
  Stutam"). Writing the key is copying from the question; the value is then found by two-token induction,
  matching the key just written against the documents. Two-token induction forms within minutes once
  one-token copy heads exist (the training script drills those first); trained from scratch on lookups
  alone it did not form within this CPU budget;
- a two-hop answer is a chain of such steps, "Zam city Vasel; Vasel country Stutam": each step is one
  lookup, the second keyed on the bridge the model has just written.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

DEMO_MODEL_DIR = Path(__file__).resolve().parent / "assets" / "demo_model"
CORPUS_FILE = "corpus.jsonl"
HELDOUT_FILE = "heldout.jsonl"

PROMPT_HEAD = "Documents:\n\n"
DOC_SEPARATOR = "\n\n"
# LangChain PromptTemplate form of :func:`build_prompt` (stuff-documents joins documents with "\n\n").
PROMPT_TEMPLATE = "Documents:\n\n{context}\n\nQuestion: {input}\nAnswer:"
CHAIN_SEPARATOR = "; "  # between the steps of a two-hop answer
# the relation words of the fact records (each one token); a key is (subject, relation)
RELATIONS = ["country", "river", "city", "founded", "founder", "born", "job", "employer"]

_ONSETS = ["b", "br", "d", "dr", "f", "g", "gr", "k", "kr", "l", "m", "n", "p", "r", "s", "st", "t", "tr", "v",
           "z", "th", "sh"]
_VOWELS = ["a", "e", "i", "o", "u", "ai", "ou"]
_CODAS = ["", "n", "r", "l", "s", "k", "m"]
JOBS = ["chemist", "baker", "pilot", "librarian", "engineer", "nurse", "painter", "carpenter", "geologist",
        "teacher", "surgeon", "architect", "sailor", "farmer", "poet", "judge", "banker", "tailor"]
YEARS = list(range(1800, 2000))
N_WORDS = 600


def make_words(n: int = N_WORDS, seed: int = 7) -> list[str]:
    """The inventory of invented entity names (two syllables, capitalised), deterministic."""
    rng = random.Random(seed)
    out: list[str] = []
    seen: set[str] = set()
    while len(out) < n:
        w = (rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_ONSETS) + rng.choice(_VOWELS)
             + rng.choice(_CODAS)).capitalize()
        if w not in seen:
            seen.add(w)
            out.append(w)
    return out


WORDS = make_words()


@dataclass
class City:
    name: str
    country: str
    river: str


@dataclass
class Org:
    name: str
    city: str
    year: int
    founder: str


@dataclass
class Person:
    name: str
    city: str
    year: int
    job: str
    org: str


@dataclass
class Doc:
    id: str
    kind: str  # "city", "org" or "person"
    entity: str
    text: str


@dataclass
class QA:
    question: str
    answer: str  # the final answer (what correctness is judged on)
    target: str  # the full trained answer text: "<subject> <relation> <answer>", or a chain of two such steps
    doc_ids: list[str]  # the documents the answer needs
    hops: int
    template: str
    context_ids: list[str] = field(default_factory=list)  # gold documents and distractors, in prompt order


@dataclass
class World:
    cities: list[City]
    orgs: list[Org]
    people: list[Person]


def make_world(rng: random.Random, n_cities: int, n_orgs: int, n_people: int) -> World:
    """Distinct invented names for every entity and attribute; relations drawn at random."""
    n_words = n_cities * 3 + n_orgs * 2 + n_people
    words = rng.sample(WORDS, n_words)
    cities = [City(words.pop(), words.pop(), words.pop()) for _ in range(n_cities)]
    orgs = [Org(words.pop(), rng.choice(cities).name, rng.choice(YEARS), words.pop()) for _ in range(n_orgs)]
    people = [Person(words.pop(), rng.choice(cities).name, rng.choice(YEARS), rng.choice(JOBS),
                     rng.choice(orgs).name) for _ in range(n_people)]
    return World(cities, orgs, people)


# Fact records: every sentence is "<subject> <relation> <value>." with each part one token after a space.
def city_text(c: City) -> str:
    return f"{c.name} country {c.country}. {c.name} river {c.river}."


def org_text(o: Org) -> str:
    return f"{o.name} city {o.city}. {o.name} founded {o.year}. {o.name} founder {o.founder}."


def person_text(p: Person) -> str:
    return f"{p.name} city {p.city}. {p.name} born {p.year}. {p.name} job {p.job}. {p.name} employer {p.org}."


def world_documents(world: World, prefix: str = "") -> list[Doc]:
    docs = [Doc(f"{prefix}city-{i}", "city", c.name, city_text(c)) for i, c in enumerate(world.cities)]
    docs += [Doc(f"{prefix}org-{i}", "org", o.name, org_text(o)) for i, o in enumerate(world.orgs)]
    docs += [Doc(f"{prefix}person-{i}", "person", p.name, person_text(p)) for i, p in enumerate(world.people)]
    return docs


Step = tuple[str, str, str]  # (subject, relation, value): one fact, one lookup


def _qa(question: str, steps: Sequence[Step], doc_ids: list[str], template: str) -> QA:
    target = CHAIN_SEPARATOR.join(f"{s} {r} {v}" for s, r, v in steps)
    return QA(question, str(steps[-1][2]), target, doc_ids, len(steps), template)


def target_pieces(target: str) -> list[tuple[str, str]]:
    """A trained answer split into restated keys ("key": copied from the question or the chain) and values
    ("answer": the looked-up tokens), each led by a space, the last ending the line."""
    pieces: list[tuple[str, str]] = []
    for i, step in enumerate(target.split(CHAIN_SEPARATOR)):
        key, value = step.rsplit(" ", 1)
        pieces.append(((CHAIN_SEPARATOR.rstrip() if i else "") + " " + key, "key"))
        pieces.append((" " + value, "answer"))
    text, kind = pieces[-1]
    pieces[-1] = (text + "\n", kind)
    return pieces


def world_questions(world: World, docs: Sequence[Doc]) -> list[QA]:
    """Every question answerable from ``docs`` (single-hop from one document, two-hop from two)."""
    by_entity = {(d.kind, d.entity): d.id for d in docs}
    city = {c.name: c for c in world.cities}
    org = {o.name: o for o in world.orgs}
    out: list[QA] = []
    for c in world.cities:
        if (cid := by_entity.get(("city", c.name))) is not None:
            out.append(_qa(f"What is the country of {c.name}?", [(c.name, "country", c.country)], [cid],
                           "city_country"))
            out.append(_qa(f"Which river flows through {c.name}?", [(c.name, "river", c.river)], [cid],
                           "city_river"))
    for o in world.orgs:
        if (oid := by_entity.get(("org", o.name))) is None:
            continue
        out.append(_qa(f"What is the city of {o.name}?", [(o.name, "city", o.city)], [oid], "org_city"))
        out.append(_qa(f"Who founded {o.name}?", [(o.name, "founder", o.founder)], [oid], "org_founder"))
        out.append(_qa(f"What is the founding year of {o.name}?", [(o.name, "founded", str(o.year))], [oid], "org_year"))
        if (cid := by_entity.get(("city", o.city))) is not None:
            out.append(_qa(f"What is the country of {o.name}?",
                           [(o.name, "city", o.city), (o.city, "country", city[o.city].country)], [oid, cid],
                           "org_country"))
    for p in world.people:
        if (pid := by_entity.get(("person", p.name))) is None:
            continue
        out.append(_qa(f"What is the city of {p.name}?", [(p.name, "city", p.city)], [pid], "person_city"))
        out.append(_qa(f"What is the birth year of {p.name}?", [(p.name, "born", str(p.year))], [pid], "person_year"))
        out.append(_qa(f"What is the job of {p.name}?", [(p.name, "job", p.job)], [pid], "person_job"))
        out.append(_qa(f"Who employs {p.name}?", [(p.name, "employer", p.org)], [pid], "person_org"))
        if (cid := by_entity.get(("city", p.city))) is not None:
            out.append(_qa(f"What is the country of {p.name}?",
                           [(p.name, "city", p.city), (p.city, "country", city[p.city].country)], [pid, cid],
                           "person_country"))
        if (oid := by_entity.get(("org", p.org))) is not None:
            work = (p.name, "employer", p.org)
            out.append(_qa(f"What is the city of the employer of {p.name}?", [work, (p.org, "city", org[p.org].city)],
                           [pid, oid], "person_work_city"))
            out.append(_qa(f"Who founded the employer of {p.name}?", [work, (p.org, "founder", org[p.org].founder)],
                           [pid, oid], "person_work_founder"))
    return out


# ---------------------------------------------------------------------------------------------- prompts
def build_prompt(doc_texts: Sequence[str], question: str) -> str:
    """The RAG prompt format the demo model was trained on (the answer follows as " <key> <value>\\n")."""
    return PROMPT_HEAD + DOC_SEPARATOR.join(doc_texts) + f"\n\nQuestion: {question}\nAnswer:"


def closed_book_prompt(question: str) -> str:
    """The control: the same question with no documents (a model that reads its documents cannot answer)."""
    return build_prompt([], question)


def normalize_answer(text: str) -> str:
    """The final answer of a generation: the last word of its first line (after the restated key and any
    chain step), trailing punctuation dropped, lower-cased. A bare value normalises to itself."""
    line = text.strip().split("\n", 1)[0] if text.strip() else ""
    words = re.sub(r"[.!?,;:]+", " ", line).split()
    return words[-1].lower() if words else ""


def is_correct(generated: str, answer: str) -> bool:
    return normalize_answer(generated) == normalize_answer(answer)


# ---------------------------------------------------------------------------------------------- training
@dataclass
class TrainingSample:
    pieces: list[tuple[str, str]]  # the text in order, each tagged "context", "question" or "answer"


def training_sample(rng: random.Random, min_docs: int = 3, max_docs: int = 8, max_questions: int = 16,
                    two_hop_share: float = 0.35) -> TrainingSample:
    """One training sequence: a fresh random world, ``min_docs``-``max_docs`` of its documents in random
    order, then up to ``max_questions`` questions answerable from them (many per sequence: the answers are
    the learning signal, and the documents cost far more tokens than the questions)."""
    world = make_world(rng, n_cities=4, n_orgs=3, n_people=4)
    docs = world_documents(world)
    rng.shuffle(docs)
    chosen = docs[: rng.randint(min_docs, max_docs)]
    qas = world_questions(world, chosen)
    two = [q for q in qas if q.hops == 2]
    one = [q for q in qas if q.hops == 1]
    picked: list[QA] = []
    for _ in range(max_questions):
        pool = two if two and rng.random() < two_hop_share else one
        if pool:
            picked.append(pool.pop(rng.randrange(len(pool))))
    head = PROMPT_HEAD + DOC_SEPARATOR.join(d.text for d in chosen)
    pieces: list[tuple[str, str]] = [(head, "context")]
    for i, q in enumerate(picked):
        pieces.append(((DOC_SEPARATOR if i == 0 else "\n") + f"Question: {q.question}\nAnswer:", "question"))
        pieces += target_pieces(q.target)
    return TrainingSample(pieces)


def tokenizer_training_text(n: int, seed: int) -> Iterable[str]:
    rng = random.Random(seed)
    for _ in range(n):
        yield "".join(t for t, _ in training_sample(rng).pieces)
    # every inventory word, year and job after a space, often enough for BPE to keep each one whole
    for _ in range(30):
        yield " " + " ".join(WORDS) + " " + " ".join(map(str, YEARS)) + " " + " ".join(JOBS + RELATIONS)


# ---------------------------------------------------------------------------------------------- corpus
def make_corpus(seed: int = 1234, n_cities: int = 30, n_orgs: int = 40, n_people: int = 60
                ) -> tuple[list[Doc], World]:
    """The bundled corpus: one world drawn with its own seed."""
    rng = random.Random(seed)
    world = make_world(rng, n_cities, n_orgs, n_people)
    return world_documents(world), world


def make_heldout(docs: Sequence[Doc], world: World, n: int = 200, seed: int = 99, two_hop_share: float = 0.3
                 ) -> list[QA]:
    """Questions over the corpus; each gets a context of its gold documents plus distractors (3-8 in all,
    shuffled), so an evaluation can be run without a retriever."""
    rng = random.Random(seed)
    qas = world_questions(world, docs)
    one = [q for q in qas if q.hops == 1]
    two = [q for q in qas if q.hops == 2]
    rng.shuffle(one)
    rng.shuffle(two)
    n_two = int(n * two_hop_share)
    picked = two[:n_two] + one[: n - n_two]
    rng.shuffle(picked)
    ids = [d.id for d in docs]
    for q in picked:
        size = rng.randint(max(3, len(q.doc_ids)), 8)
        distractors = rng.sample([i for i in ids if i not in q.doc_ids], size - len(q.doc_ids))
        ctx = list(q.doc_ids) + distractors
        rng.shuffle(ctx)
        q.context_ids = ctx
    return picked


def write_jsonl(path: Path, rows: Iterable[Any]) -> None:
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(asdict(row) if hasattr(row, "__dataclass_fields__") else row) + "\n")


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def load_corpus(model_dir: Path | str = DEMO_MODEL_DIR) -> list[dict[str, Any]]:
    """The bundled documents: dicts with id, kind, entity, text."""
    return read_jsonl(Path(model_dir) / CORPUS_FILE)


def load_heldout(model_dir: Path | str = DEMO_MODEL_DIR) -> list[dict[str, Any]]:
    """The held-out questions: dicts with question, answer, doc_ids, hops, template, context_ids."""
    return read_jsonl(Path(model_dir) / HELDOUT_FILE)


def heldout_prompt(q: dict[str, Any], corpus_by_id: dict[str, str]) -> str:
    return build_prompt([corpus_by_id[i] for i in q["context_ids"]], q["question"])


def demo_model_available(model_dir: Path | str = DEMO_MODEL_DIR) -> bool:
    d = Path(model_dir)
    return all((d / f).exists() for f in ("config.json", "model.safetensors", "tokenizer.json", CORPUS_FILE,
                                          HELDOUT_FILE))


# ---------------------------------------------------------------------------------------------- evaluation
@dataclass
class EvalResult:
    question: str
    answer: str
    generated: str
    correct: bool
    hops: int
    ttft_s: float
    reuse_ratio: float


def _answer_all(rag: Any, questions: Sequence[dict[str, Any]], prompt_of: Any, repair: str,
                max_new_tokens: int) -> list[EvalResult]:
    out: list[EvalResult] = []
    for q in questions:
        r = rag.generate(prompt_of(q), max_new_tokens=max_new_tokens, stop="\n", repair=repair, store_prefix=False)
        out.append(EvalResult(q["question"], q["answer"], r.text, is_correct(r.text, q["answer"]), int(q["hops"]),
                              r.ttft_s, r.reuse_ratio))
    return out


def evaluate(rag: Any, questions: Sequence[dict[str, Any]], corpus_by_id: dict[str, str], *, repair: str,
             max_new_tokens: int = 12) -> list[EvalResult]:
    """Greedy answers to held-out questions over their stored contexts, through ``KVBoostRAG`` in transparent
    mode (documents warmed in ``rag`` are found in the flat prompt and their KV re-placed).

    Nothing is stored from the prompts (``store_prefix=False``), so no question gets exact-prefix hits from an
    earlier one and ``repair="full"`` is a plain full prefill of the same ids."""
    return _answer_all(rag, questions, lambda q: heldout_prompt(q, corpus_by_id), repair, max_new_tokens)


def evaluate_closed_book(rag: Any, questions: Sequence[dict[str, Any]], max_new_tokens: int = 12) -> list[EvalResult]:
    """Greedy answers with no documents in the prompt: the floor a model gets from priors alone."""
    return _answer_all(rag, questions, lambda q: closed_book_prompt(q["question"]), "full", max_new_tokens)


def accuracy(results: Sequence[EvalResult], hops: int | None = None) -> float:
    rows = [r for r in results if hops is None or r.hops == hops]
    return sum(r.correct for r in rows) / len(rows) if rows else float("nan")
