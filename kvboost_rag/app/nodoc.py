"""Questions without documents: does a reader adapter cost the model anything outside RAG (issue #32, item 5)?

64 hand-written English questions in three kinds, each checkable by case-insensitive containment
(:func:`kvboost_rag.app.rag_corpus.is_correct`):

- ``fact``: very common world facts a small chat model may know (the capital of France, days in a week...);
- ``arithmetic``: small sums, differences and products, answered in digits (the word form is an alias);
- ``instruction``: a simple instruction with a short checkable output ("Reply with only the word yes.").

:func:`evaluate` answers every question greedily with plain HF (a full prefill, then greedy steps on HF's own
cache, as the RAG benchmark's reference does) once per gate of a :class:`kvboost_core.lora.reader.ReaderAdapter`:
``None`` runs the base weights, ``True`` the adapted model. With two gates it reports the second's accuracy
against the first's on the same questions (paired bootstrap interval and McNemar's exact test).

Stdlib only at import; torch is imported when :func:`evaluate` runs.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any

from kvboost_rag.app.rag_corpus import CorpusQuestion
from kvboost_rag.app.rag_corpus import is_correct as _is_correct

SYSTEM = "You are a helpful assistant. Be brief."
KINDS = ("fact", "arithmetic", "instruction")
_PACKAGE = "kvboost_rag.app"
_PATH = ("assets", "nodoc", "questions.json")


@dataclass(frozen=True, slots=True)
class NoDocQuestion:
    id: str
    kind: str  # one of KINDS
    question: str
    answer: str
    aliases: tuple[str, ...] = ()

    def corpus_question(self) -> CorpusQuestion:
        """The question as :func:`kvboost_rag.app.rag_corpus.is_correct` takes it (no gold document)."""
        return CorpusQuestion(self.id, "", self.question, self.answer, self.aliases)


def is_correct(answer_text: str, q: NoDocQuestion) -> bool:
    """Whether ``answer_text`` contains the gold answer or an alias (the RAG corpus's rule)."""
    return _is_correct(answer_text, q.corpus_question())


def _field(obj: dict[str, Any], key: str, where: str) -> str:
    value = obj.get(key)
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{where}: field {key!r} must be a non-empty string")
    return value


def parse(data: Any, source: str = "nodoc questions") -> tuple[NoDocQuestion, ...]:
    """The questions of a version-1 JSON object; ``source`` names it in errors."""
    if not isinstance(data, dict) or data.get("version") != 1:
        raise ValueError(f"{source}: expected an object with version 1")
    raw = data.get("questions")
    if not isinstance(raw, list) or not raw:
        raise ValueError(f"{source}: 'questions' must be a non-empty list")
    out: list[NoDocQuestion] = []
    seen: set[str] = set()
    for i, q in enumerate(raw):
        where = f"{source}: question {i}"
        if not isinstance(q, dict):
            raise ValueError(f"{where}: expected an object, got {type(q).__name__}")
        qid = _field(q, "id", where)
        where = f"{source}: question {qid}"
        if qid in seen:
            raise ValueError(f"{where}: duplicate id")
        seen.add(qid)
        kind = _field(q, "kind", where)
        if kind not in KINDS:
            raise ValueError(f"{where}: kind must be one of {KINDS}, got {kind!r}")
        aliases = q.get("aliases", [])
        if not isinstance(aliases, list) or not all(isinstance(a, str) and a.strip() for a in aliases):
            raise ValueError(f"{where}: 'aliases' must be a list of non-empty strings")
        out.append(NoDocQuestion(qid, kind, _field(q, "question", where), _field(q, "answer", where),
                                 tuple(aliases)))
    return tuple(out)


def load_questions(path: str | os.PathLike[str] | None = None) -> tuple[NoDocQuestion, ...]:
    """The package's questions (or the file at ``path``, same format); ValueError on a malformed file."""
    if path is None:
        source = "/".join(_PATH)
        text = resources.files(_PACKAGE).joinpath(*_PATH).read_text(encoding="utf-8")
    else:
        source = os.fspath(path)
        with open(path, encoding="utf-8") as f:
            text = f.read()
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{source}: not valid JSON ({e})") from e
    return parse(data, source)


def messages(q: NoDocQuestion) -> list[dict[str, str]]:
    """The chat for one question: the system prompt, then the question as the user turn."""
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q.question}]


def gate_name(gate: Any) -> str:
    """``base`` for gate None (base weights), ``adapted`` for True (the adapter on every row)."""
    if gate is None:
        return "base"
    if gate is True:
        return "adapted"
    return str(gate)


def _accuracy(flags: Sequence[bool], questions: Sequence[NoDocQuestion]) -> dict[str, Any]:
    from kvboost_rag.app.bench.stats import rate_with_ci

    per_kind: dict[str, dict[str, Any]] = {}
    for kind in KINDS:
        sub = [f for f, q in zip(flags, questions) if q.kind == kind]
        if sub:
            per_kind[kind] = {"correct": sum(sub), "n": len(sub), "accuracy": sum(sub) / len(sub)}
    return {"correct": sum(flags), "n": len(flags), "accuracy": sum(flags) / len(flags),
            "ci": rate_with_ci(flags), "per_kind": per_kind}


def evaluate(model: Any, tokenizer: Any, chat_prompt_ids: Callable[[list[dict[str, str]]], list[int]],
             eos: set[int], max_new_tokens: int = 24, gates: Sequence[Any] = (None,), lora: Any = None,
             questions: Sequence[NoDocQuestion] | None = None) -> dict[str, Any]:
    """Greedy answers by plain HF to every question (the package's set unless ``questions`` is given), once
    per gate: inside ``lora.gated(gate)`` when ``lora`` is given (None: base weights, True: adapted).

    Returns a JSON-able dict: ``gates`` (their names), ``accuracy`` per gate name (overall with a Wilson
    interval, and per kind), ``answers`` (per question, each gate's answer and whether it is right) and, with
    two gates, ``paired``: the second gate's accuracy against the first's
    (:func:`kvboost_rag.app.bench.stats.paired_accuracy`)."""
    from contextlib import nullcontext

    from kvboost_rag.app.bench.rag import hf_greedy
    from kvboost_rag.app.bench.stats import paired_accuracy

    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    gates = tuple(gates)
    if not gates:
        raise ValueError("need at least one gate")
    names = [gate_name(g) for g in gates]
    if len(set(names)) != len(names):
        raise ValueError(f"gates must differ, got {names}")
    if lora is None and any(g is not None for g in gates):
        raise ValueError("a gate other than None needs a lora (reader adapter)")
    qs = tuple(load_questions() if questions is None else questions)
    if not qs:
        raise ValueError("need at least one question")
    prompts = [list(chat_prompt_ids(messages(q))) for q in qs]
    answers: dict[str, list[str]] = {}
    flags: dict[str, list[bool]] = {}
    for gate, name in zip(gates, names):
        ctx = lora.gated(gate) if lora is not None else nullcontext()
        with ctx:
            texts = [hf_greedy(model, tokenizer, ids, max_new_tokens, eos).text.strip() for ids in prompts]
        answers[name] = texts
        flags[name] = [is_correct(t, q) for t, q in zip(texts, qs)]
    result: dict[str, Any] = {
        "n": len(qs),
        "max_new_tokens": max_new_tokens,
        "gates": names,
        "accuracy": {name: _accuracy(flags[name], qs) for name in names},
        "answers": [
            {"id": q.id, "kind": q.kind, "question": q.question, "gold": q.answer,
             **{name: {"answer": answers[name][i], "correct": flags[name][i]} for name in names}}
            for i, q in enumerate(qs)
        ],
    }
    if len(names) == 2:
        ref, got = names
        paired = paired_accuracy(flags[ref], flags[got]).to_dict()
        # kept_right is NaN when the reference gets nothing right: None keeps the dict strict JSON
        result["paired"] = {"reference": ref, "setting": got,
                            **{k: None if isinstance(v, float) and math.isnan(v) else v for k, v in paired.items()}}
    return result
