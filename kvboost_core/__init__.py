"""kvboost_core: position-independent KV cache reuse for HuggingFace RoPE decoder models."""

from kvboost_core.config import EngineConfig
from kvboost_core.segments import Segment

__all__ = ["EngineConfig", "Segment"]
