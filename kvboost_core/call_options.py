"""A call's options as one typed value, built once at the engine's edge and carried down.

The engine's public methods (``generate``, ``stream``, ``prefill``) take flat keywords, as callers write them.
:func:`call_options` turns them into a :class:`CallOptions` at the edge: unknown names are a ``TypeError``,
every value is checked as :class:`~kvboost_core.config.EngineConfig` checks its own, and the repair settings
become one :class:`~kvboost_core.repair.RepairSpec` (the config's, with the call's overrides). Everything below
the edge (prefill, the canonical job, the server's batch prefill, backfill) reads that value and never the loose
keywords again. A caller may build it earlier with ``KVEngine.call_options(...)`` and pass it as ``options=``; the
framework skins do, at their own entry (``kvboost_rag.options.typed_call`` -> ``KVBoostRAG.generate(call_options=)``
-> ``KVEngine.generate(options=)``), so the ``repair`` setting can be followed from a skin's call to the forward as
one object.

:data:`~kvboost_core.config.REPAIR_OPTIONS` is the one list of per-call repair names: the engine's keywords and
the skins' per-call options (``kvboost_rag.options.ENGINE_KEYS``) read it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from kvboost_core.config import (
    REPAIR_OPTIONS,
    EngineConfig,
    RepairSpec,
    validate_adaptive,
    validate_check_layer,
    validate_flag,
    validate_recheck,
    validate_repair,
)

# Per-call options that are not repair settings.
OTHER_OPTIONS = ("add_special_tokens", "store_prefix", "history_tokens", "turn_end")
CALL_OPTIONS = REPAIR_OPTIONS + OTHER_OPTIONS
__all__ = ["CALL_OPTIONS", "REPAIR_OPTIONS", "CallOptions", "call_options", "check_history_tokens", "repair_spec"]


def repair_spec(config: EngineConfig, num_layers: int | None, **overrides: Any) -> RepairSpec:
    """``config``'s repair settings with the call's ``overrides`` (None: the config's), validated as the config
    validates its own. A per-call ``check_layer``/``recheck_layer`` is also checked against the model's
    ``num_layers`` (the config's are clamped to the last layer, since the config does not know the model)."""
    unknown = sorted(set(overrides) - set(REPAIR_OPTIONS))
    if unknown:
        raise TypeError(f"unexpected repair option(s) {', '.join(unknown)}; accepted: {', '.join(REPAIR_OPTIONS)}")
    given = {k: v for k, v in overrides.items() if v is not None}
    if "check_layer" in given:
        validate_check_layer(given["check_layer"], num_layers)
    validate_flag("reuse_repaired", overrides.get("reuse_repaired", True), allow_none=False)  # None: not a bool
    spec = replace(config.repair_spec, **given)
    validate_repair(spec.repair, spec.recompute_ratio, spec.select)
    validate_recheck(spec.recheck_layer, spec.recheck_ratio, spec.check_layer,
                     num_layers if "recheck_layer" in given else None)
    validate_adaptive(spec.recompute_mass, spec.max_recompute_ratio, spec.query_tokens)
    return spec


def check_history_tokens(value: Any, turn_end: Any = ()) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise ValueError(f"history_tokens must be None or an int >= 0, got {value!r}")
    if isinstance(turn_end, (str, bytes)) or not all(isinstance(t, int) and not isinstance(t, bool)
                                                     for t in turn_end):
        raise ValueError(f"turn_end must be a sequence of token ids, got {turn_end!r}")


@dataclass(frozen=True, slots=True)
class CallOptions:
    """One call's options, checked: what the generation and prefill paths read below the engine's edge."""

    spec: RepairSpec
    add_special_tokens: bool | None = None  # None: the tokenizer's default
    store_prefix: bool | None = None  # None: the config's
    history_tokens: int | None = None  # a chat turn's history length (kvboost_core.engine.exact_history); None: one-shot
    turn_end: tuple[int, ...] = ()  # what the chat template writes after an answer

    @property
    def chat(self) -> bool:
        return self.history_tokens is not None


def call_options(config: EngineConfig, num_layers: int | None, kw: Mapping[str, Any]) -> CallOptions:
    """The flat per-call keywords ``kw`` as one checked :class:`CallOptions` (TypeError for an unknown name,
    ValueError naming the argument for a bad value)."""
    unknown = sorted(set(kw) - set(CALL_OPTIONS))
    if unknown:
        raise TypeError(f"unexpected keyword argument(s) {', '.join(unknown)}; accepted: {', '.join(CALL_OPTIONS)}")
    spec = repair_spec(config, num_layers, **{k: kw[k] for k in REPAIR_OPTIONS if k in kw})
    validate_flag("add_special_tokens", kw.get("add_special_tokens"))
    validate_flag("store_prefix", kw.get("store_prefix"))
    turn_end: Sequence[int] = kw.get("turn_end", ())
    check_history_tokens(kw.get("history_tokens"), turn_end)
    return CallOptions(spec, kw.get("add_special_tokens"), kw.get("store_prefix"), kw.get("history_tokens"),
                       tuple(turn_end))
