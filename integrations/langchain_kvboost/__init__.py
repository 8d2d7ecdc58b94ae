"""LangChain integration of kvboost-rag: thin skins over ``kvboost_rag.KVBoostRAG``."""

try:
    import langchain_core  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError("langchain_kvboost needs LangChain; install it with `pip install kvboost-rag[langchain]`") \
        from exc

from langchain_kvboost.chat_models import ChatKVBoost, to_chat_dicts
from langchain_kvboost.embeddings import KVHashEmbeddings
from langchain_kvboost.llms import KVBoostLLM
from langchain_kvboost.warming import KVWarmTransformer, add_documents_warmed

__all__ = ["ChatKVBoost", "KVBoostLLM", "KVHashEmbeddings", "KVWarmTransformer", "add_documents_warmed",
           "to_chat_dicts"]
