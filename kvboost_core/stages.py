"""The engine's stages as the modules around it see them: one declared, type-checked interface.

:class:`kvboost_core.engine.KVEngine` is assembled from one module per stage (:mod:`~kvboost_core.engine.base`:
state and tokenization, :mod:`~kvboost_core.engine.prefill`: chunk, plan, place, forward, stats and stored blocks,
:mod:`~kvboost_core.engine.warming`, :mod:`~kvboost_core.engine.generation`,
:mod:`~kvboost_core.engine.exact_history`). The serving and tuning modules that drive those stages from outside
(:mod:`~kvboost_core.serving.canonical`, :mod:`~kvboost_core.serving.batch`, :mod:`~kvboost_core.tuning.fidelity`,
:mod:`~kvboost_core.tuning.autocalib`) take the engine as an :class:`EngineStages` (the tuning modules as a
:class:`TuningEngine`, which adds the plain-HF reference and the public calls they measure) and read nothing else
of it: no private attribute (``tests/test_public_api.py`` checks the source), so what they depend on is this list.

Data flows one way through it: text -> :meth:`~EngineStages.prompt_chunks` (tokens, segments, chunks) -> a plan
(:func:`kvboost_core.assembly.lookup` over :attr:`~EngineStages.store`) -> :meth:`~EngineStages.new_cache` +
:func:`kvboost_core.assembly.place` -> forward -> :meth:`~EngineStages.prefill_stats` and
:meth:`~EngineStages.stored_block` for what is kept.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from kvboost_core.assembly import Chunk, Plan
    from kvboost_core.config import EngineConfig
    from kvboost_core.keys import Fingerprint
    from kvboost_core.model.driver import ModelDriver, ScatterCache
    from kvboost_core.repair import RepairSpec
    from kvboost_core.results import AssembledCache, Counters, GenerationResult, PrefillResult, PrefillStats
    from kvboost_core.segments import TokenizedSegment
    from kvboost_core.store import KVBlock, KVStore

# A prompt ready for planning: its segments, its token count and its chunks.
Prepared = tuple[list["TokenizedSegment"], int, list["Chunk"]]


class EngineStages(Protocol):
    """What the engine offers the modules that drive its stages (see the module docstring)."""

    @property
    def config(self) -> EngineConfig: ...
    @property
    def driver(self) -> ModelDriver: ...
    @property
    def store(self) -> KVStore: ...
    @property
    def fingerprint(self) -> Fingerprint: ...  # keys the stored KV (a block adapter included)
    @property
    def counters(self) -> Counters: ...
    @property
    def eos_token_ids(self) -> frozenset[int]: ...
    @property
    def warm_prefix_ids(self) -> tuple[int, ...]: ...

    def tokenize_ids(self, prompt: Any, add_special_tokens: bool | None = None) -> list[int]: ...

    def prompt_chunks(self, prompt: Any, add_special_tokens: bool | None) -> Prepared:
        """Tokenize and chunk a prompt; refuses an empty one or one over the context."""
        ...

    def spans(self, ids: Sequence[int]) -> list[tuple[int, int]]:
        """Chunk boundaries of a token sequence."""
        ...

    def split_at(self, prepared: Prepared, history: int, turn_end: Sequence[int] = ()) -> Prepared:
        """The prompt re-chunked so the history is cut per message: at ``history`` and after every ``turn_end``."""
        ...

    def chat_canonical(self) -> bool:
        """Can chat calls take the canonical path (a layer-wise model, no reader or block adapter)?"""
        ...

    def turn_answer(self, generated: Sequence[int], text: str, turn_end: Sequence[int]) -> list[int]:
        """A chat answer's ids as the next turn's history holds them."""
        ...

    def new_cache(self, capacity: int) -> ScatterCache:
        """Empty per-layer KV buffers for ``capacity`` positions."""
        ...

    def stored_block(self, cache: ScatterCache | AssembledCache, ids: Sequence[int], start: int, *, kind: str,
                     parent: Any, digest: bytes = b"") -> KVBlock:
        """Positions ``[start, start + len(ids))`` of ``cache`` as a store entry (quantized per the config)."""
        ...

    def prefill_stats(self, plan: Plan, final: torch.Tensor, spec: RepairSpec, per_layer: list[int]
                      ) -> PrefillStats:
        """What a prefill reused, recomputed and computed, by the one definition of each count."""
        ...


class TuningEngine(EngineStages, Protocol):
    """What the tuning modules (:mod:`~kvboost_core.tuning.fidelity`, :mod:`~kvboost_core.tuning.calibrate`,
    :mod:`~kvboost_core.tuning.autocalib`) use besides the stages: the plain-HF reference they measure against,
    the engine's public calls they measure, and where a calibration is recorded."""

    config: EngineConfig  # settable: a calibration becomes the defaults of the calls that start after it
    model: Any  # the HF model (plain HF forwards are the reference)
    calibration: dict[str, Any] | None  # the applied calibration, as the engine reports it

    def tokenize(self, prompt: Any, add_special_tokens: bool | None = None) -> list[TokenizedSegment]: ...

    def full_prefill_logits(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Next-token logits of a plain HF full prefill of ``token_ids``."""
        ...

    def prefill(self, prompt: Any, *, repair: str | None = None, recompute_ratio: float | None = None,
                check_layer: int | None = None, store_prefix: bool | None = None,
                reuse_repaired: bool = True) -> PrefillResult: ...

    def generate(self, prompt: Any, max_new_tokens: int = 256, **kw: Any) -> GenerationResult: ...
