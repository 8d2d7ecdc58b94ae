"""Rendering framework documents to the exact text a framework puts in a prompt.

The registry keys a document by that text, so what we warm and what the chain later formats must agree:
LangChain's default document prompt is ``{page_content}``; LlamaIndex formats nodes with
``get_content(metadata_mode=MetadataMode.LLM)``.
"""

from __future__ import annotations

from typing import Any

from kvboost_rag._lazy import require


def _is_llama_index_node(doc: Any) -> bool:
    # Checked by module name so that llama_index is imported only when such an object is actually passed.
    return type(doc).__module__.startswith("llama_index") and hasattr(doc, "get_content")


def document_text(doc: Any) -> str:
    """The text a framework renders for ``doc``: a str as is, a LangChain Document's ``page_content``, a
    LlamaIndex node's LLM-mode content (text plus the metadata the LLM is meant to see)."""
    if isinstance(doc, str):
        return doc
    if _is_llama_index_node(doc):
        mode = require("llama_index.core.schema").MetadataMode
        return str(doc.get_content(metadata_mode=mode.LLM))
    content = getattr(doc, "page_content", None)
    if isinstance(content, str):
        return content
    raise TypeError(f"cannot read text from a {type(doc).__name__}; pass a str, a LangChain Document or a "
                    "LlamaIndex node (or render it to a str yourself)")


def document_texts(docs: Any) -> list[str]:
    """``document_text`` over one document or an iterable of them."""
    if isinstance(docs, str) or hasattr(docs, "page_content") or _is_llama_index_node(docs):
        return [document_text(docs)]
    try:
        items = list(docs)
    except TypeError:
        raise TypeError(f"expected documents (a str, a Document, a node or a list of them), got "
                        f"{type(docs).__name__}") from None
    return [document_text(d) for d in items]
