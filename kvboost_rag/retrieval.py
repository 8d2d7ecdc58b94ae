"""A tiny in-memory FAISS retriever and a deterministic hashing embedding, for examples and offline tests."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from kvboost_rag._lazy import require
from kvboost_rag.documents import document_text

_WORD = re.compile(r"\w+", re.UNICODE)


class HashingEmbedding:
    """Bag of lower-cased words (and word bigrams) hashed into ``dim`` signed buckets, L2-normalised.
    Deterministic across processes and machines (xxh64, not Python's salted hash); no model needed."""

    def __init__(self, dim: int = 512, *, bigrams: bool = True) -> None:
        if dim < 8:
            raise ValueError(f"dim must be >= 8, got {dim}")
        self.dim = dim
        self.bigrams = bigrams

    def _features(self, text: str) -> list[str]:
        words = [w.lower() for w in _WORD.findall(text) if len(w) > 2]  # short words: mostly noise
        return words + ([f"{a} {b}" for a, b in zip(words, words[1:], strict=False)] if self.bigrams else [])

    def embed_one(self, text: str) -> np.ndarray:
        vec = np.zeros(self.dim, dtype=np.float32)
        for f in self._features(text):
            h = xxhash.xxh64_intdigest(f.encode("utf-8"))
            vec[h % self.dim] += 1.0 if (h >> 63) & 1 else -1.0
        norm = float(np.linalg.norm(vec))
        return vec / norm if norm > 0 else vec

    def __call__(self, texts: Sequence[str]) -> np.ndarray:
        return np.stack([self.embed_one(t) for t in texts]) if texts else np.zeros((0, self.dim), np.float32)

    # LangChain's Embeddings protocol, so an instance can be wrapped or passed where a callable is accepted.
    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        return self(texts).tolist()

    def embed_query(self, text: str) -> list[float]:
        return self.embed_one(text).tolist()


@dataclass(frozen=True, slots=True)
class Hit:
    document: Any
    score: float  # inner product of normalised vectors (cosine similarity)


class FaissIndex:
    """Exact inner-product FAISS index over ``embed(texts) -> (n, dim)`` vectors; keeps the documents."""

    def __init__(self, embed: Callable[[Sequence[str]], Any]) -> None:
        self._embed = embed
        self._index: Any = None
        self._docs: list[Any] = []

    def __len__(self) -> int:
        return len(self._docs)

    def _vectors(self, texts: Sequence[str]) -> np.ndarray:
        vecs = np.ascontiguousarray(np.asarray(self._embed(list(texts)), dtype=np.float32))
        if vecs.ndim != 2 or vecs.shape[0] != len(texts):
            raise ValueError(f"embed must return an (n, dim) array for n texts, got shape {vecs.shape}")
        return vecs

    def add(self, docs: Sequence[Any]) -> None:
        """Add strs, LangChain Documents or LlamaIndex nodes (embedded by their rendered text)."""
        faiss = require("faiss")
        if not docs:
            return
        vecs = self._vectors([document_text(d) for d in docs])
        if self._index is None:
            self._index = faiss.IndexFlatIP(vecs.shape[1])
        elif vecs.shape[1] != self._index.d:
            raise ValueError(f"embedding dim changed from {self._index.d} to {vecs.shape[1]}")
        self._index.add(vecs)
        self._docs.extend(docs)

    def search(self, query: str, k: int = 4) -> list[Hit]:
        if self._index is None or k < 1:
            return []
        scores, idx = self._index.search(self._vectors([query]), min(k, len(self._docs)))
        return [Hit(self._docs[i], float(s)) for s, i in zip(scores[0], idx[0], strict=True) if i >= 0]
