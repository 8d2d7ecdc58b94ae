"""kvboost_core: position-independent KV cache reuse for HuggingFace RoPE decoder models.

The public API is what this package exports (``__all__``); the application layer, the integrations and the
benchmarks import from here, so the modules behind it can change without touching them:

- the engine: :class:`KVEngine` (``warm``, ``prefill``, ``generate``, ``stream``, ``verify``, ``calibrate``,
  ``stats``; read-only ``eos_token_ids`` and ``warm_prefix_ids``), its :class:`EngineConfig` and
  :class:`GenerationStream`;
- prompts: :class:`Segment` (a document, or text between documents);
- results: :class:`GenerationResult`, :class:`PrefillResult` (its typed :class:`PrefillStats`),
  :class:`WarmResult`, and
  :class:`CacheCounts` (:func:`cache_counts`): the one definition of cached tokens (exact and block-exact
  reuse) and of approximate reuse, kept apart on every surface;
- a call's options as one value: :class:`CallOptions` (:func:`call_options`), whose :class:`RepairSpec` is built
  once at the engine's edge from the config and the call's overrides;
- the stages other modules drive: :class:`EngineStages` (a typed interface the engine implements);
- sampling: :class:`SamplingParams`, :data:`LogitsProcessor`, :class:`StopGeneration` (raised by a logits
  processor to end a generation).

Stores are public in :mod:`kvboost_core.store`, model short names in :mod:`kvboost_core.zoo`. Names other than
these are internal. ``import kvboost_core`` stays light: a name that needs torch (the engine, sampling) is
imported on its first use (PEP 562 module ``__getattr__``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvboost_core.config import EngineConfig
from kvboost_core.lazy import lazy_exports
from kvboost_core.segments import Segment

_LAZY = {"KVEngine": "kvboost_core.engine", "GenerationStream": "kvboost_core.engine.generation",
         "CacheCounts": "kvboost_core.results", "cache_counts": "kvboost_core.results",
         "GenerationResult": "kvboost_core.results", "PrefillResult": "kvboost_core.results",
         "WarmResult": "kvboost_core.results", "PrefillStats": "kvboost_core.results",
         "CallOptions": "kvboost_core.call_options", "call_options": "kvboost_core.call_options",
         "RepairSpec": "kvboost_core.config", "EngineStages": "kvboost_core.stages",
         "SamplingParams": "kvboost_core.decode",
         "LogitsProcessor": "kvboost_core.decode", "StopGeneration": "kvboost_core.decode"}

if TYPE_CHECKING:
    from kvboost_core.call_options import CallOptions, call_options
    from kvboost_core.config import RepairSpec
    from kvboost_core.decode import LogitsProcessor, SamplingParams, StopGeneration
    from kvboost_core.engine import KVEngine
    from kvboost_core.engine.generation import GenerationStream
    from kvboost_core.results import (
        CacheCounts,
        GenerationResult,
        PrefillResult,
        PrefillStats,
        WarmResult,
        cache_counts,
    )
    from kvboost_core.stages import EngineStages


__getattr__, __dir__ = lazy_exports(__name__, _LAZY, globals())


__all__ = ["CacheCounts", "CallOptions", "EngineConfig", "EngineStages", "GenerationResult", "GenerationStream",
           "KVEngine", "LogitsProcessor", "PrefillResult", "PrefillStats", "RepairSpec", "SamplingParams", "Segment",
           "StopGeneration", "WarmResult", "cache_counts", "call_options"]
