"""Training chats for the block adapter at scale (issue #32): real English prose plus invented-entity documents.

Two document pools, neither shared with the hand-written splits (tune/eval/heldout/dev/test):

- **prose**: paragraphs of real English that this machine has offline: the docstrings of the Python standard
  library (module, class and function docs, parsed with ``ast``, never imported) and the long descriptions of the
  installed distributions (their ``METADATA``). Paragraphs of 45-150 words with little code in them.
- **entities**: :func:`kvboost_rag.app.synth_corpus.synthetic_corpus` (six kinds of templated entity documents,
  each with fact questions and gold answers).

Questions come in several kinds, so the adapter sees more than one shape of reading:

- ``lookup``: a fact question about one entity document (gold answer known);
- ``complete``: complete a sentence of a named document (gold: the sentence's next words);
- ``which``: which document (by title) contains a quoted phrase (gold: the title);
- ``two``: two questions about two documents in one turn;
- ``about``: what a named document is about (no gold: the teacher's answer is the target);

and a share of chats carry an earlier turn (the documents came with it; the new question follows). The teacher
is the base model's full prefill of each chat (:mod:`.distill`), so gold answers are optional; they are kept for
gold-answer supervision and scoring. Deterministic in the seed and the machine's stdlib and distributions (the
pool's hash is logged with every run). Stdlib only.
"""

from __future__ import annotations

import ast
import hashlib
import random
import re
import sysconfig
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from kvboost_rag.app.bench.rag_chat import SYSTEM, user_message

MIN_WORDS, MAX_WORDS = 45, 150
MAX_PER_SOURCE = 10  # paragraphs per stdlib module or distribution, so no one source dominates
KINDS = ("lookup", "complete", "which", "two", "about")
KS = (2, 3, 4, 4, 5, 6, 6, 8, 8, 10, 12, 16)  # documents per chat
HISTORY_SHARE = 0.2
ENTITIES_PER_CORPUS = 240


@dataclass(frozen=True, slots=True)
class TrainDoc:
    title: str
    text: str
    group: str  # source module / distribution / entity kind: distractors come from the same group first
    qa: tuple[tuple[str, str], ...] = ()  # fact questions with gold answers (entity documents)

    def render(self) -> str:
        return f"{self.title}\n{self.text}"


@dataclass(frozen=True, slots=True)
class TrainChat:
    messages: tuple[dict[str, str], ...]
    docs: tuple[str, ...]  # the documents' texts as they appear in the prompt
    kind: str
    gold: str | None  # the answer a reader should give, where one is known


def _prose_ok(p: str) -> bool:
    words = p.split()
    if not MIN_WORDS <= len(words) <= MAX_WORDS:
        return False
    if sum(c in "()[]{}=<>_*`|\\:@#$%" for c in p) / len(p) > 0.015:
        return False
    return p[0].isupper() and p.rstrip()[-1] in ".!?" and "http" not in p and ">>>" not in p


def _paragraphs(text: str) -> Iterator[str]:
    for p in re.split(r"\n\s*\n", text):
        p = " ".join(p.split())
        if p and _prose_ok(p):
            yield p


def stdlib_docs() -> list[TrainDoc]:
    """Docstring paragraphs of the standard library (tests, idlelib and site-packages left out)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out: list[TrainDoc] = []
    for f in sorted(root.rglob("*.py")):
        rel = f.relative_to(root)
        if rel.parts[0] in {"site-packages", "idlelib", "test", "lib2to3", "turtledemo"} or "tests" in rel.parts:
            continue
        try:
            tree = ast.parse(f.read_text(encoding="utf-8", errors="ignore"))
        except (SyntaxError, ValueError):
            continue
        module = ".".join(rel.with_suffix("").parts).removesuffix(".__init__")
        taken = 0
        for node in ast.walk(tree):
            if taken >= MAX_PER_SOURCE:
                break
            if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            doc = ast.get_docstring(node)
            if not doc:
                continue
            name = module if isinstance(node, ast.Module) else f"{module}.{node.name}"
            for i, p in enumerate(_paragraphs(doc)):
                out.append(TrainDoc(f"Notes on {name}" + (f" ({i + 1})" if i else ""), p, f"py:{module}"))
                taken += 1
    return out


def distribution_docs() -> list[TrainDoc]:
    """Paragraphs of the installed distributions' long descriptions."""
    out: list[TrainDoc] = []
    seen: set[str] = set()
    for dist in sorted(metadata.distributions(), key=lambda d: str(d.metadata["Name"] or "").lower()):
        name = str(dist.metadata["Name"] or "")
        if not name or name.lower() in seen:
            continue
        seen.add(name.lower())
        body = dist.metadata.get_payload() if hasattr(dist.metadata, "get_payload") else ""
        for i, p in enumerate(list(_paragraphs(str(body or "")))[:MAX_PER_SOURCE]):
            out.append(TrainDoc(f"About {name}" + (f" ({i + 1})" if i else ""), p, f"dist:{name}"))
    return out


def entity_docs(n: int, seed: int) -> list[TrainDoc]:
    from kvboost_rag.app.synth_corpus import synthetic_corpus

    out: list[TrainDoc] = []
    titles: set[str] = set()
    part = 0
    while len(out) < n:  # one synthetic corpus draws its values without replacement: 240 documents each
        corpus = synthetic_corpus(min(ENTITIES_PER_CORPUS, n - len(out)), seed * 1000 + part)
        part += 1
        qa: dict[str, list[tuple[str, str]]] = {}
        for q in corpus.questions:
            qa.setdefault(q.doc_id, []).append((q.question, q.answer))
        for d in corpus.documents:
            if d.title not in titles:  # a name drawn again in another part: keep the first
                titles.add(d.title)
                out.append(TrainDoc(d.title, d.text, f"entity:{d.kind}", tuple(qa.get(d.id, ()))))
    return out


def pool_hash(docs: Sequence[TrainDoc]) -> str:
    h = hashlib.sha256()
    for d in docs:
        h.update(d.render().encode())
    return h.hexdigest()[:16]


def _sentences(text: str) -> list[str]:
    return [s for s in re.split(r"(?<=[.!?])\s+", text) if len(s.split()) >= 10]


def _question(kind: str, golds: Sequence[TrainDoc], rng: random.Random) -> tuple[str, str | None] | None:
    """The question text and its gold answer (None: no gold), or None when ``golds`` cannot carry ``kind``."""
    d = golds[0]
    if kind == "lookup":
        return rng.choice(d.qa) if d.qa else None
    if kind == "two":
        if len(golds) < 2 or not (d.qa and golds[1].qa):
            return None
        (q1, a1), (q2, a2) = rng.choice(d.qa), rng.choice(golds[1].qa)
        return f"{q1} Also: {q2[0].lower()}{q2[1:]}", f"{a1}; {a2}"
    if kind == "complete":
        sents = _sentences(d.text)
        if not sents:
            return None
        words = rng.choice(sents).split()
        cut = rng.randint(4, min(8, len(words) - 4))
        return (f'In "{d.title}", how does the sentence that begins "{" ".join(words[:cut])}" continue?',
                " ".join(words[cut: cut + 5]))
    if kind == "which":
        words = d.text.split()
        if len(words) < 12:
            return None
        i = rng.randrange(0, len(words) - 5)
        phrase = " ".join(words[i: i + 5]).strip(".,;:")
        return f'Which document contains the words "{phrase}"? Give its title.', d.title
    if kind == "about":
        return f'What is "{d.title}" about? Answer in one sentence.', None
    raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")


def _cut(text: str, rng: random.Random) -> str:
    """Half the documents keep all sentences; the rest keep a random leading share (at least two)."""
    if rng.random() < 0.5:
        return text
    sents = re.split(r"(?<=[.!?])\s+", text)
    keep = max(2, int(len(sents) * rng.uniform(0.5, 0.9)))
    return " ".join(sents[:keep])


def make_chats(docs: Sequence[TrainDoc], n: int, seed: int, kinds: Sequence[str] = KINDS) -> list[TrainChat]:
    """``n`` chats over ``docs``: question kinds cycled, k drawn from :data:`KS`, distractors half from the gold
    document's group, a share with an earlier turn. Deterministic in (docs, n, seed, kinds)."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    unknown = set(kinds) - set(KINDS)
    if unknown or not kinds:
        raise ValueError(f"kinds must be a non-empty subset of {KINDS}, got {list(kinds)!r}")
    rng = random.Random(seed)
    by_group: dict[str, list[int]] = {}
    for i, d in enumerate(docs):
        by_group.setdefault(d.group, []).append(i)
    with_qa = [i for i, d in enumerate(docs) if d.qa]
    chats: list[TrainChat] = []
    while len(chats) < n:
        kind = kinds[len(chats) % len(kinds)]
        first = rng.choice(with_qa) if kind in ("lookup", "two") and with_qa else rng.randrange(len(docs))
        golds = [first]
        if kind == "two":
            golds.append(rng.choice([i for i in with_qa if i != first]))
        made = _question(kind, [docs[i] for i in golds], rng)
        if made is None:
            continue
        question, gold = made
        k = max(len(golds), rng.choice(KS))
        same = [i for i in by_group[docs[first].group] if i not in golds]
        picked = rng.sample(same, min(len(same), (k - len(golds)) // 2))
        rest = [i for i in range(len(docs)) if i not in golds and i not in picked]
        picked += rng.sample(rest, k - len(golds) - len(picked))
        order = golds + picked
        rng.shuffle(order)
        texts = tuple(_cut(docs[i].render(), rng) if i not in golds else docs[i].render() for i in order)
        msgs: list[dict[str, str]] = [{"role": "system", "content": SYSTEM}]
        if rng.random() < HISTORY_SHARE:
            earlier = _question("complete", [docs[rng.choice(order)]], rng)
            if earlier is None or earlier[1] is None:
                earlier = (f'What is "{docs[order[0]].title}" about?', docs[order[0]].text.split(". ")[0] + ".")
            msgs += [{"role": "user", "content": user_message(earlier[0], texts)},
                     {"role": "assistant", "content": f"{earlier[1]}."}]
            msgs.append({"role": "user", "content": f"Question: {question}"})
        else:
            msgs.append({"role": "user", "content": user_message(question, texts)})
        chats.append(TrainChat(tuple(msgs), texts, kind, gold))
    return chats


def training_pool(n_entities: int = 1200, seed: int = 0) -> list[TrainDoc]:
    """The default pool: stdlib and distribution prose, then ``n_entities`` entity documents; every title unique
    (a repeated one, such as two classes' methods of one name, gets a number)."""
    out: list[TrainDoc] = []
    seen: Counter[str] = Counter()
    for d in stdlib_docs() + distribution_docs() + entity_docs(n_entities, seed):
        seen[d.title] += 1
        out.append(d if seen[d.title] == 1 else TrainDoc(f"{d.title} [{seen[d.title]}]", d.text, d.group, d.qa))
    return out
