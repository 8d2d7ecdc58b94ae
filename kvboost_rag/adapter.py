"""The former module of :class:`~kvboost_rag.rag.KVBoostRAG`: ``from kvboost_rag.adapter import KVBoostRAG`` and
the other names keep working. New code imports from :mod:`kvboost_rag.rag` or :mod:`kvboost_rag`."""

from kvboost_rag.rag import *  # noqa: F403
