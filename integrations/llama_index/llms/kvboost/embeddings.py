"""A deterministic, offline LlamaIndex embedding (hashed bag of words) for examples: no model download."""

from __future__ import annotations

from typing import Any

from llama_index.core.embeddings import BaseEmbedding
from pydantic import PrivateAttr

from kvboost_rag.retrieval import HashingEmbedding


class KVHashEmbedding(BaseEmbedding):
    """kvboost_rag.retrieval.HashingEmbedding as a LlamaIndex embedding; use a real embedding model in practice."""

    dim: int = 512
    _embed: HashingEmbedding = PrivateAttr()

    def __init__(self, **data: Any) -> None:
        super().__init__(**data)
        self._embed = HashingEmbedding(self.dim)

    @classmethod
    def class_name(cls) -> str:
        return "KVHashEmbedding"

    def _get_text_embedding(self, text: str) -> list[float]:
        return self._embed.embed_query(text)

    def _get_query_embedding(self, query: str) -> list[float]:
        return self._embed.embed_query(query)

    async def _aget_query_embedding(self, query: str) -> list[float]:
        return self._embed.embed_query(query)
