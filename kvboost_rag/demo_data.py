"""Synthetic RAG data for the embedded demo model: invented worlds, documents, questions, prompts.

The same code generates the training stream (``scripts/train_demo_model.py``), the bundled corpus and
held-out questions (``kvboost_rag/assets/demo_model``), and formats prompts for the CLI and the tests, so
the model is always asked questions in exactly the format it was trained on.

Entities are invented names built from syllables. A fixed share of all names (chosen by a stable hash) is
reserved for the bundled corpus and never appears in training, so every held-out question is about
entities the model has not seen: it can only answer by reading the documents in its prompt.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import xxhash

DEMO_MODEL_DIR = Path(__file__).resolve().parent / "assets" / "demo_model"
CORPUS_FILE = "corpus.jsonl"
HELDOUT_FILE = "heldout.jsonl"

PROMPT_HEAD = "Documents:\n\n"
DOC_SEPARATOR = "\n\n"
# LangChain PromptTemplate form of :func:`build_prompt` (stuff-documents joins documents with "\n\n").
PROMPT_TEMPLATE = "Documents:\n\n{context}\n\nQuestion: {input}\nAnswer:"

_ONSETS = ["b", "br", "c", "d", "dr", "f", "g", "gr", "h", "k", "kr", "l", "m", "n", "p", "qu", "r", "s", "st",
           "t", "tr", "v", "z", "th", "sh"]
_VOWELS = ["a", "e", "i", "o", "u", "ai", "ei", "ou"]
_CODAS = ["", "", "", "n", "r", "l", "s", "th", "ck", "m", "x"]
_ORG_KINDS = ["Institute", "Company", "Museum", "Library", "Observatory", "Guild", "Foundation", "Academy",
              "Bank", "Theatre", "Hospital", "University"]
JOBS = ["chemist", "baker", "pilot", "librarian", "engineer", "nurse", "painter", "carpenter", "geologist",
        "teacher", "surgeon", "architect", "sailor", "farmer", "poet", "judge", "banker", "tailor", "jeweller",
        "astronomer"]
HOLDOUT_MOD = 5  # a name whose stable hash is 0 mod this is reserved for the bundled corpus


def _stable_hash(text: str) -> int:
    return xxhash.xxh64_intdigest(text.encode("utf-8"))


def is_heldout_name(name: str) -> bool:
    return _stable_hash(name) % HOLDOUT_MOD == 0


def _word(rng: random.Random, syllables: int) -> str:
    w = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) for _ in range(syllables - 1))
    return (w + rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS)).capitalize()


class NameSource:
    """Draws distinct invented names, from the held-out share or from the training share only."""

    def __init__(self, rng: random.Random, heldout: bool) -> None:
        self.rng = rng
        self.heldout = heldout
        self.used: set[str] = set()

    def _draw(self, make: Any) -> str:
        for _ in range(10_000):
            name = make()
            if name not in self.used and is_heldout_name(name) == self.heldout:
                self.used.add(name)
                return name
        raise RuntimeError("name space exhausted; widen the syllable inventory")

    def person(self) -> str:
        return self._draw(lambda: f"{_word(self.rng, self.rng.choice((2, 2, 3)))} {_word(self.rng, 2)}")

    def place(self) -> str:
        return self._draw(lambda: _word(self.rng, self.rng.choice((2, 3))))

    def org(self) -> str:
        return self._draw(lambda: f"{_word(self.rng, 2)} {self.rng.choice(_ORG_KINDS)}")


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
    answer: str
    doc_ids: list[str]  # the documents the answer needs
    hops: int
    template: str
    context_ids: list[str] = field(default_factory=list)  # gold documents and distractors, in prompt order


@dataclass
class World:
    cities: list[City]
    orgs: list[Org]
    people: list[Person]


def make_world(rng: random.Random, names: NameSource, n_cities: int, n_orgs: int, n_people: int) -> World:
    cities = [City(names.place(), names.place(), names.place()) for _ in range(n_cities)]
    orgs = [Org(names.org(), rng.choice(cities).name, rng.randint(1600, 1990), names.person())
            for _ in range(n_orgs)]
    people = [Person(names.person(), rng.choice(cities).name, rng.randint(1900, 1999), rng.choice(JOBS),
                     rng.choice(orgs).name) for _ in range(n_people)]
    return World(cities, orgs, people)


def _city_text(c: City, variant: int) -> str:
    if variant == 0:
        return f"{c.name} is a city in the country of {c.country}. The river {c.river} flows through {c.name}."
    return f"The city of {c.name} lies in {c.country}, on the banks of the river {c.river}."


def _org_text(o: Org, variant: int) -> str:
    if variant == 0:
        return f"{o.name} is located in the city of {o.city}. It was founded in {o.year} by {o.founder}."
    return f"Founded by {o.founder} in {o.year}, {o.name} is based in the city of {o.city}."


def _person_text(p: Person, variant: int) -> str:
    if variant == 0:
        return f"{p.name} was born in {p.city} in {p.year}. {p.name} works as a {p.job} at {p.org}."
    return f"{p.name} is a {p.job} at {p.org}. {p.name} was born in {p.year} in the city of {p.city}."


def world_documents(world: World, rng: random.Random, prefix: str = "") -> list[Doc]:
    docs = [Doc(f"{prefix}city-{i}", "city", c.name, _city_text(c, rng.randint(0, 1)))
            for i, c in enumerate(world.cities)]
    docs += [Doc(f"{prefix}org-{i}", "org", o.name, _org_text(o, rng.randint(0, 1)))
             for i, o in enumerate(world.orgs)]
    docs += [Doc(f"{prefix}person-{i}", "person", p.name, _person_text(p, rng.randint(0, 1)))
             for i, p in enumerate(world.people)]
    return docs


def world_questions(world: World, docs: Sequence[Doc]) -> list[QA]:
    """Every question answerable from ``docs`` (single-hop from one document, two-hop from two)."""
    by_entity = {(d.kind, d.entity): d.id for d in docs}
    city = {c.name: c for c in world.cities}
    org = {o.name: o for o in world.orgs}
    out: list[QA] = []
    for c in world.cities:
        if (cid := by_entity.get(("city", c.name))) is not None:
            out.append(QA(f"In which country is {c.name}?", c.country, [cid], 1, "city_country"))
            out.append(QA(f"Which river flows through {c.name}?", c.river, [cid], 1, "city_river"))
    for o in world.orgs:
        if (oid := by_entity.get(("org", o.name))) is None:
            continue
        out.append(QA(f"In which city is {o.name} located?", o.city, [oid], 1, "org_city"))
        out.append(QA(f"Who founded {o.name}?", o.founder, [oid], 1, "org_founder"))
        out.append(QA(f"In which year was {o.name} founded?", str(o.year), [oid], 1, "org_year"))
        if (cid := by_entity.get(("city", o.city))) is not None:
            out.append(QA(f"In which country is {o.name} located?", city[o.city].country, [oid, cid], 2,
                          "org_country"))
    for p in world.people:
        if (pid := by_entity.get(("person", p.name))) is None:
            continue
        out.append(QA(f"Where was {p.name} born?", p.city, [pid], 1, "person_city"))
        out.append(QA(f"In which year was {p.name} born?", str(p.year), [pid], 1, "person_year"))
        out.append(QA(f"What is the job of {p.name}?", p.job, [pid], 1, "person_job"))
        out.append(QA(f"Where does {p.name} work?", p.org, [pid], 1, "person_org"))
        if (cid := by_entity.get(("city", p.city))) is not None:
            out.append(QA(f"In which country was {p.name} born?", city[p.city].country, [pid, cid], 2,
                          "person_country"))
        if (oid := by_entity.get(("org", p.org))) is not None:
            out.append(QA(f"In which city does {p.name} work?", org[p.org].city, [pid, oid], 2, "person_work_city"))
            out.append(QA(f"Who founded the organisation where {p.name} works?", org[p.org].founder, [pid, oid], 2,
                          "person_work_founder"))
    return out


# ---------------------------------------------------------------------------------------------- prompts
def build_prompt(doc_texts: Sequence[str], question: str) -> str:
    """The RAG prompt format the demo model was trained on (the answer follows as " <answer>\\n")."""
    return PROMPT_HEAD + DOC_SEPARATOR.join(doc_texts) + f"\n\nQuestion: {question}\nAnswer:"


def normalize_answer(text: str) -> str:
    """First line, trimmed, trailing punctuation dropped, lower-cased, inner whitespace collapsed."""
    line = text.strip().split("\n", 1)[0] if text.strip() else ""
    return re.sub(r"\s+", " ", line.strip().rstrip(".!?,;:").strip()).lower()


def is_correct(generated: str, answer: str) -> bool:
    return normalize_answer(generated) == normalize_answer(answer)


# ---------------------------------------------------------------------------------------------- training
@dataclass
class TrainingSample:
    prompt: str  # documents and the first question, ending with "Answer:"
    pieces: list[tuple[str, bool]]  # the text in order; True marks answer text (weighted in the loss)
    questions: list[QA]


def training_sample(rng: random.Random, min_questions: int = 2, max_questions: int = 8,
                    repeat_share: float = 0.5) -> TrainingSample:
    """One training sequence: a fresh world of training-share names, 3-8 of its documents in random order,
    then ``min_questions``-``max_questions`` questions answerable from them (two-hop preferred a third of the time)."""
    names = NameSource(rng, heldout=False)
    world = make_world(rng, names, n_cities=3, n_orgs=3, n_people=3)
    docs = world_documents(world, rng)
    rng.shuffle(docs)
    chosen = docs[: rng.randint(3, 8)]
    qas = world_questions(world, chosen)
    two = [q for q in qas if q.hops == 2]
    one = [q for q in qas if q.hops == 1]
    picked: list[QA] = []
    # Questions are cheap next to the documents they read, and their answers are the learnable signal.
    for _ in range(rng.randint(min_questions, max_questions)):
        pool = two if two and rng.random() < 0.35 else one
        if pool:
            picked.append(pool.pop(rng.randrange(len(pool))))
    prompt = PROMPT_HEAD + DOC_SEPARATOR.join(d.text for d in chosen)
    pieces: list[tuple[str, bool]] = [(prompt, False)]
    for i, q in enumerate(picked):
        pieces.append(((DOC_SEPARATOR if i == 0 else "\n") + f"Question: {q.question}\nAnswer:", False))
        pieces.append((f" {q.answer}\n", True))
    if rng.random() < repeat_share:
        # Copying the documents again, in a new order, is pure induction (every token after a document's
        # first is predictable from the first copy): the circuit question answering is built on, and one a
        # small model trained for minutes did not find from the answers alone (loss flat for 25 minutes).
        again = [d.text for d in chosen]
        rng.shuffle(again)
        pieces.append(("\nRepeat:\n\n" + DOC_SEPARATOR.join(again) + "\n", True))
    first = prompt + f"\n\nQuestion: {picked[0].question}\nAnswer:"
    return TrainingSample(first, pieces, picked)


def tokenizer_training_text(n: int, seed: int) -> Iterable[str]:
    rng = random.Random(seed)
    for _ in range(n):
        yield "".join(t for t, _ in training_sample(rng).pieces)


# ---------------------------------------------------------------------------------------------- corpus
def make_corpus(seed: int = 1234, n_cities: int = 30, n_orgs: int = 40, n_people: int = 60
                ) -> tuple[list[Doc], World]:
    """The bundled corpus: one world of held-out-share names (never seen in training)."""
    rng = random.Random(seed)
    world = make_world(rng, NameSource(rng, heldout=True), n_cities, n_orgs, n_people)
    return world_documents(world, rng), world


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


def evaluate(rag: Any, questions: Sequence[dict[str, Any]], corpus_by_id: dict[str, str], *, repair: str,
             max_new_tokens: int = 12) -> list[EvalResult]:
    """Greedy answers to held-out questions over their stored contexts, through ``KVBoostRAG`` in transparent
    mode (documents warmed in ``rag`` are found in the flat prompt and their KV re-placed).

    Nothing is stored from the prompts (``store_prefix=False``), so no question gets exact-prefix hits from an
    earlier one and ``repair="full"`` is a plain full prefill of the same ids."""
    out: list[EvalResult] = []
    for q in questions:
        r = rag.generate(heldout_prompt(q, corpus_by_id), max_new_tokens=max_new_tokens, stop="\n",
                         repair=repair, store_prefix=False)
        out.append(EvalResult(q["question"], q["answer"], r.text, is_correct(r.text, q["answer"]), int(q["hops"]),
                              r.ttft_s, r.reuse_ratio))
    return out


def accuracy(results: Sequence[EvalResult], hops: int | None = None) -> float:
    rows = [r for r in results if hops is None or r.hops == hops]
    return sum(r.correct for r in rows) / len(rows) if rows else float("nan")
