"""Templated RAG chats about invented entities, for training a reader adapter (``kvboost-rag adapt``).

The hand-written ``tune`` split has 32 documents and 64 questions: a reader adapter trained on it sees the same
few documents in every chat. This module writes as many encyclopedic documents as asked, from templates with
random invented names, numbers and sentence order, in six kinds (towns, rivers, ships, painters, companies,
festivals), each with two questions about its facts. Entity names are unique, so a question (it names its
entity) has one right document; its answer string need not be unique: goods, foods and some numbers recur
across documents (62 of 480 answers at 240 documents appear in more than one), which keeps distractors
confusable as a real retriever's are.
Distillation needs prompts, not gold answers (the teacher is the base model's own full-prefill answer), but the
questions carry gold answers anyway so the set can also be scored.

It shares no names or documents with the hand-written ``eval`` split, which stays held out. Deterministic in
``seed``. Stdlib only.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from kvboost_rag.app.rag_corpus import CorpusDoc, CorpusQuestion, RagCorpus

_ONSETS = ("b", "br", "c", "d", "dr", "f", "g", "gr", "h", "k", "l", "m", "n", "p", "r", "s", "st", "t", "th",
           "v", "w", "z", "qu", "sh", "tr")
_VOWELS = ("a", "e", "i", "o", "u", "ae", "ei", "ou", "y")
_CODAS = ("", "n", "r", "l", "m", "s", "th", "nd", "rk", "st", "x")
_FIRST = ("Ilsa", "Marten", "Odile", "Corvin", "Talia", "Brannoc", "Edda", "Lucan", "Sabin", "Petra", "Ansel",
          "Rhosyn", "Tamsin", "Ivo", "Greta", "Caspar", "Linnea", "Osric", "Verity", "Hollis", "Mira", "Dorian")
_GOODS = ("copper pots", "woollen blankets", "glass lanterns", "clockwork toys", "rope", "salted fish",
          "paper fans", "iron nails", "leather saddles", "candles", "silk ribbons", "barrel hoops", "tin whistles",
          "ceramic tiles", "oak chairs", "maps", "umbrellas", "sundials", "bells", "spectacles")
_COLOURS = ("crimson", "pale green", "ochre", "slate blue", "silver", "violet", "amber", "white", "black",
            "teal", "rust red", "golden")
_FOODS = ("plum dumplings", "smoked eel", "honey cakes", "barley soup", "pickled pears", "walnut bread",
          "onion tarts", "cheese pastries", "lamb stew", "baked apples", "mushroom pies", "spiced buns")
_MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
           "November", "December")


# kind-neutral sentences that lengthen a document to the hand-written corpus's size ({} is the entity's name)
_EXTRA = ("A short history of {} was written by a local schoolteacher and is sold at the post office.",
          "Old photographs of {} are kept in the regional archive.",
          "Travellers in the last century described {} as quiet and well kept.",
          "The name {} is said to come from an old word for a meeting place.",
          "Several local songs mention {}, though few people remember all the words.",
          "A plaque near the main road tells visitors the story of {}.",
          "In wet years the roads around {} are often flooded for a week or two.",
          "Schoolchildren from the region visit {} on a yearly outing.")


class _Names:
    """Invented names, never repeated within one corpus."""

    def __init__(self, rng: random.Random) -> None:
        self.rng, self.used = rng, set[str]()

    def word(self, syllables: int = 2) -> str:
        while True:
            w = "".join(self.rng.choice(_ONSETS) + self.rng.choice(_VOWELS) for _ in range(syllables))
            w = (w + self.rng.choice(_CODAS)).capitalize()
            if w not in self.used and 4 <= len(w) <= 11:
                self.used.add(w)
                return w

    def person(self) -> str:
        return f"{self.rng.choice(_FIRST)} {self.word()}"


class _Unique:
    """Draws values (numbers, words) that no other document of the corpus uses."""

    def __init__(self, rng: random.Random) -> None:
        self.rng, self.used = rng, set[str]()

    def number(self, lo: int, hi: int, fmt: str = "{:,}", step: int = 1) -> str:
        while True:
            s = fmt.format(self.rng.randrange(lo, hi, step))
            if s not in self.used:
                self.used.add(s)
                return s

    def choice(self, pool: tuple[str, ...]) -> str | None:
        free = [p for p in pool if p not in self.used]
        if not free:
            return None
        v = self.rng.choice(free)
        self.used.add(v)
        return v


# A kind writes (title, sentences, [(question, answer)]) from a name source and a value source.
_Kind = Callable[[random.Random, _Names, _Unique], tuple[str, list[str], list[tuple[str, str]]]]


def _town(rng: random.Random, n: _Names, u: _Unique) -> tuple[str, list[str], list[tuple[str, str]]]:
    name, river, founder = n.word(), n.word(), n.person()
    year, pop = u.number(1420, 1890, "{}"), u.number(1200, 48000, step=50)
    food = u.choice(_FOODS) or "bread"
    s = [f"{name} is a town in the province of {n.word()}.",
         f"It lies on the {river} River, where the road from the coast crosses the valley.",
         f"The town was founded in {year} by {founder}, who built the first inn beside the ford.",
         f"At the last census {name} had a population of {pop} people.",
         f"Its best known dish is {food}, served at the autumn fair.",
         f"The market square is paved with {rng.choice(_COLOURS)} stone from a quarry upstream."]
    qs = [(f"In what year was {name} founded?", year), (f"Who founded {name}?", founder),
          (f"What is the population of {name}?", pop), (f"On which river does {name} lie?", river)]
    return name, s, qs


def _river(rng: random.Random, n: _Names, u: _Unique) -> tuple[str, list[str], list[tuple[str, str]]]:
    name, source, mouth = n.word(), n.word(), n.word()
    length, bridges = u.number(40, 900, "{}"), u.number(3, 60, "{}")
    s = [f"The {name} is a river that rises on the slopes of Mount {source}.",
         f"It is {length} kilometres long and flows into Lake {mouth}.",
         f"The {name} is crossed by {bridges} bridges, the oldest of them built of timber.",
         f"Its water is {rng.choice(_COLOURS)} in spring, coloured by clay from the hills.",
         f"Barges once carried {rng.choice(_GOODS)} down the {name} to the lake ports.",
         f"The river freezes most winters in {rng.choice(_MONTHS)}."]
    qs = [(f"How long is the {name} river?", f"{length} kilometres"),
          (f"Where does the {name} river rise?", f"Mount {source}"),
          (f"Into which lake does the {name} flow?", f"Lake {mouth}")]
    return f"{name} (river)", s, qs


def _ship(rng: random.Random, n: _Names, u: _Unique) -> tuple[str, list[str], list[tuple[str, str]]]:
    name, yard, captain = n.word(), n.word(), n.person()
    year, crew = u.number(1700, 1935, "{}"), u.number(12, 480, "{}")
    cargo = u.choice(_GOODS) or "grain"
    s = [f"The {name} was a merchant ship launched in {year} at the shipyard of {yard}.",
         f"Her first captain was {captain}.",
         f"She carried a crew of {crew} sailors.",
         f"On most voyages she carried {cargo} to the southern islands.",
         f"Her hull was painted {rng.choice(_COLOURS)}, which made her easy to spot from the harbour.",
         f"She was broken up after a storm damaged her masts in {rng.choice(_MONTHS)}."]
    qs = [(f"In what year was the {name} launched?", year), (f"Who was the first captain of the {name}?", captain),
          (f"How many sailors were in the crew of the {name}?", crew), (f"What did the {name} carry?", cargo)]
    return f"{name} (ship)", s, qs


def _painter(rng: random.Random, n: _Names, u: _Unique) -> tuple[str, list[str], list[tuple[str, str]]]:
    name, town, teacher = n.person(), n.word(), n.person()
    born, works = u.number(1500, 1920, "{}"), u.number(20, 900, "{}")
    painting = f"The {rng.choice(_COLOURS).title()} {n.word()}"
    s = [f"{name} was a painter born in {born} in the town of {town}.",
         f"As a young artist {name.split()[0]} studied under {teacher}.",
         f"About {works} paintings are known, most of them harbour scenes.",
         f"The most famous painting by {name.split()[0]} is \"{painting}\", which hangs in the city museum.",
         f"{name.split()[0]} painted mostly in the early morning, when the light was soft.",
         f"Late in life the painter also designed {rng.choice(_GOODS)} for a local workshop."]
    qs = [(f"In what year was {name} born?", born), (f"Who taught {name}?", teacher),
          (f"What is the most famous painting by {name}?", painting),
          (f"Where was {name} born?", town)]
    return name, s, qs


def _company(rng: random.Random, n: _Names, u: _Unique) -> tuple[str, list[str], list[tuple[str, str]]]:
    name, city, founder = f"{n.word()} Works", n.word(), n.person()
    year, staff = u.number(1780, 1990, "{}"), u.number(30, 9000, step=10)
    product = u.choice(_GOODS) or "tools"
    s = [f"{name} is a company based in the city of {city}.",
         f"It was founded in {year} by {founder}.",
         f"The company is best known for its {product}.",
         f"It employs {staff} people in two factories.",
         f"Its logo is a {rng.choice(_COLOURS)} circle with a hammer inside it.",
         f"Every {rng.choice(_MONTHS)} the company opens its workshops to visitors."]
    qs = [(f"Who founded {name}?", founder), (f"In what year was {name} founded?", year),
          (f"What is {name} best known for?", product), (f"How many people does {name} employ?", staff)]
    return name, s, qs


def _festival(rng: random.Random, n: _Names, u: _Unique) -> tuple[str, list[str], list[tuple[str, str]]]:
    name, village = f"{n.word()} Festival", n.word()
    month = rng.choice(_MONTHS)
    visitors, first = u.number(500, 60000, step=100), u.number(1600, 1995, "{}")
    food = u.choice(_FOODS) or "soup"
    s = [f"The {name} is held every {month} in the village of {village}.",
         f"It was first held in {first}.",
         f"About {visitors} visitors come each year.",
         f"The traditional food of the festival is {food}.",
         f"Dancers wear {rng.choice(_COLOURS)} sashes during the evening procession.",
         f"Stalls in the square sell {rng.choice(_GOODS)} and other crafts."]
    qs = [(f"Where is the {name} held?", village), (f"In what year was the {name} first held?", first),
          (f"How many visitors come to the {name} each year?", visitors),
          (f"What is the traditional food of the {name}?", food)]
    return name, s, qs


KINDS: dict[str, _Kind] = {"town": _town, "river": _river, "ship": _ship, "painter": _painter,
                           "company": _company, "festival": _festival}


def synthetic_corpus(n_docs: int, seed: int = 0) -> RagCorpus:
    """``n_docs`` documents (kinds cycled, entity names unique) with 2 questions each."""
    if isinstance(n_docs, bool) or not isinstance(n_docs, int) or n_docs < 1:
        raise ValueError(f"n_docs must be an int >= 1, got {n_docs!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    rng = random.Random(seed)
    names, values = _Names(rng), _Unique(rng)
    kinds = list(KINDS)
    docs: list[CorpusDoc] = []
    questions: list[CorpusQuestion] = []
    for i in range(n_docs):
        kind = kinds[i % len(kinds)]
        title, sentences, qa = KINDS[kind](rng, names, values)
        extra = [t.format(title.split(" (")[0]) for t in rng.sample(_EXTRA, 2)]
        head, rest = sentences[:1], sentences[1:] + extra
        rng.shuffle(rest)  # varied sentence order; the defining sentence stays first
        doc = CorpusDoc(f"s{seed}-{i:04d}", title, " ".join(head + rest), kind)
        docs.append(doc)
        for j, (q, a) in enumerate(rng.sample(qa, 2)):
            questions.append(CorpusQuestion(f"{doc.id}-q{j}", doc.id, q, a))
    return RagCorpus(tuple(docs), tuple(questions))
