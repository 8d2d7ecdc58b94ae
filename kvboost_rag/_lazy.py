"""Optional framework imports with an install hint, so ``import kvboost_rag`` never pulls in LangChain or
LlamaIndex."""

from __future__ import annotations

import importlib
from types import ModuleType

_EXTRAS = {"langchain": "langchain", "langchain_core": "langchain", "langchain_community": "langchain",
           "langchain_classic": "langchain", "llama_index": "llamaindex", "faiss": "", "tqdm": ""}


def require(module: str) -> ModuleType:
    """Import ``module`` or raise ImportError naming the pip command that provides it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        root = module.split(".")[0]
        extra = _EXTRAS.get(root)
        hint = f"pip install kvboost-rag[{extra}]" if extra else f"pip install {root.replace('_', '-')}"
        raise ImportError(f"{module} is needed for this feature; install it with `{hint}`") from exc


def loaded(module: str) -> ModuleType | None:
    """The module if it is importable, else None (used for duck-typed isinstance checks)."""
    try:
        return importlib.import_module(module)
    except ImportError:
        return None
