"""The engine shell: :class:`KVEngine`, one class assembled from one mixin per stage.

- :mod:`.base`: what every stage reads, the engine's state (set once by ``KVEngine.__init__``) and the prompt's
  tokens;
- :mod:`.prefill`: lookup, place, forward (the repair schedule), stats, and the prefix stored;
- :mod:`.warming`: each document's KV, computed once and stored as content entries;
- :mod:`.generation`: the decode loop, as a whole result or a text stream;
- :mod:`.exact_history`: chat turns (the history read exactly, in canonical chunks) and the background backfill;
- :mod:`.kvengine`: the class itself: construction (weights, adapters, the warm prefix, calibration) and
  introspection (stats, verify, calibrate).

Imports: anything of kvboost_core below it (the cache pipeline, :mod:`kvboost_core.model`,
:mod:`kvboost_core.serving`, :mod:`kvboost_core.lora`, :mod:`kvboost_core.tuning`, the store). It sits on top:
nothing else in kvboost_core imports it but the package face ``kvboost_core/__init__.py``, lazily, and the modules
that drive the engine from outside (serving, tuning) see it as :class:`kvboost_core.stages.EngineStages`. Only
these modules read the engine's private state (``tests/test_layout.py``, ``tests/test_public_api.py``).

``from kvboost_core import KVEngine`` is the public import; ``from kvboost_core.engine import KVEngine`` works too.
"""

from kvboost_core.engine.kvengine import KVEngine

__all__ = ["KVEngine"]
