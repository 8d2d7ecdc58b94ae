"""The RAG chat the real-model benchmarks ask and how their answers are compared.

A system turn, then one user turn holding the retrieved documents and the question, rendered by the model's
own chat template. The benchmark (:mod:`.rag`, :mod:`.rag_ttft`, :mod:`.multiturn`), the adapter trainers
(``kvboost-rag adapt``) and the demo share it, so an adapter is trained on the format it is measured on.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

SYSTEM = "You are a helpful assistant. Answer the question using only the documents. Be brief."
DEFAULT_MODEL = "smollm2-135m-instruct"


def user_message(question: str, docs: Sequence[str]) -> str:
    body = "\n\n".join(docs)
    return f"Documents:\n\n{body}\n\nQuestion: {question}"


def messages(question: str, docs: Sequence[str]) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user_message(question, docs)}]


def first_sentence(text: str) -> str:
    """Normalized first sentence: lower case, single spaces, no trailing punctuation."""
    t = " ".join(text.strip().split()).lower()
    m = re.search(r"[.!?](\s|$)|\n", t)  # "3.5" has no space after its point: not an end
    t = t[: m.start()] if m else t
    return t.strip(" .!?,;:\"'")
