"""kvboost_core: position-independent KV cache reuse for HuggingFace RoPE decoder models.

``from kvboost_core import KVEngine`` works; the engine (and with it torch and transformers) is imported on
first use of the name, so ``import kvboost_core`` stays light (PEP 562 module ``__getattr__``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvboost_core.config import EngineConfig
from kvboost_core.lazy import lazy_exports
from kvboost_core.segments import Segment

_LAZY = {"KVEngine": "kvboost_core.engine", "GenerationResult": "kvboost_core.results",
         "WarmResult": "kvboost_core.results"}

if TYPE_CHECKING:
    from kvboost_core.engine import KVEngine
    from kvboost_core.results import GenerationResult, WarmResult


__getattr__, __dir__ = lazy_exports(__name__, _LAZY, globals())


__all__ = ["EngineConfig", "GenerationResult", "KVEngine", "Segment", "WarmResult"]
