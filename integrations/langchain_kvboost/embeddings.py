"""A deterministic, offline LangChain embedding (hashed bag of words) for examples and tests."""

from __future__ import annotations

from langchain_core.embeddings import Embeddings

from kvboost_rag.retrieval import HashingEmbedding


class KVHashEmbeddings(Embeddings):
    """kvboost_rag.retrieval.HashingEmbedding as LangChain Embeddings; no model, same vectors everywhere."""

    def __init__(self, dim: int = 512) -> None:
        self._embed = HashingEmbedding(dim)

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        return self._embed.embed_documents(list(texts))

    def embed_query(self, text: str) -> list[float]:
        return self._embed.embed_query(text)
