"""LlamaIndex integration of kvboost-rag: ``from llama_index.llms.kvboost import KVBoostLLM``."""

from llama_index.llms.kvboost.base import KVBoostLLM, registry_key, render_node
from llama_index.llms.kvboost.embeddings import KVHashEmbedding
from llama_index.llms.kvboost.ingestion import KVWarmer, StableOrderPostprocessor

__all__ = ["KVBoostLLM", "KVHashEmbedding", "KVWarmer", "StableOrderPostprocessor", "registry_key", "render_node"]
