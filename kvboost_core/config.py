"""Engine configuration: one validated, immutable dataclass."""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Any

PRECISIONS = ("fp32", "fp16")  # EngineConfig.weights (kvboost_core.model.weights)


def check_precision(weights: object) -> str:
    """``weights`` if it names a precision in :data:`PRECISIONS`; a TypeError or ValueError naming it otherwise."""
    if not isinstance(weights, str):
        raise TypeError(f"weights must be one of {PRECISIONS}, got {type(weights).__name__}")
    if weights not in PRECISIONS:
        raise ValueError(f"weights must be one of {PRECISIONS}, got {weights!r}")
    return weights

REPAIRS = ("none", "selective", "cacheblend", "full")
SELECTS = ("deviation", "value", "key", "recency", "deviation_recency")

_UNITS = {"": 1, "B": 1, "K": 1000, "KB": 1000, "KIB": 1024, "M": 1000**2, "MB": 1000**2, "MIB": 1024**2,
          "G": 1000**3, "GB": 1000**3, "GIB": 1024**3, "T": 1000**4, "TB": 1000**4, "TIB": 1024**4}


def parse_bytes(value: int | str) -> int:
    """``"2GiB"`` → 2147483648. Accepts ints and strings with SI or IEC units."""
    if isinstance(value, bool):
        raise TypeError("max_cache_bytes must be an int or a string such as '2GiB', not a bool")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"byte budget must be >= 0, got {value}")
        return value
    if not isinstance(value, str):
        raise TypeError(f"byte budget must be an int or a string such as '2GiB', got {type(value).__name__}")
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", value)
    if not m or m.group(2).upper() not in _UNITS:
        raise ValueError(f"cannot parse byte size {value!r}; use e.g. 512MiB, 2GiB or 1000000")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


# A namespace names a directory on disk and a Redis key prefix, so it is a fixed character set: no glob
# metacharacters, no path separators, no leading dot ("." / ".." would walk out of the store's directory).
NAMESPACE_RE = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]{0,63}")


def validate_namespace(namespace: object) -> str:
    if not isinstance(namespace, str) or NAMESPACE_RE.fullmatch(namespace) is None:
        raise ValueError(f"namespace must match {NAMESPACE_RE.pattern} (1-64 letters, digits, '_', '-', '.', "
                         f"not starting with '.'), got {namespace!r}")
    return namespace


@dataclass(frozen=True, slots=True)
class RepairSpec:
    """One call's repair settings, built once at the engine's edge (:func:`kvboost_core.call_options.repair_spec`:
    the config's, :attr:`EngineConfig.repair_spec`, with the call's overrides) and read by every stage below it."""

    repair: str
    recompute_ratio: float
    check_layer: int
    select: str
    overlap_k: int
    reuse_repaired: bool = True  # serve prefix entries stored from earlier repaired prefills as exact hits
    recompute_mass: float = 0.0  # > 0: adaptive, keep the top scores covering this share of the total
    max_recompute_ratio: float = 1.0  # the adaptive selection's upper bound
    query_tokens: int = 0  # > 0: weight scores by the attention of the last N computed tokens (query-aware)
    recheck_layer: int | None = None  # a second check layer: re-score the kept tokens there and narrow them
    recheck_ratio: float = 0.0  # share of the candidates still recomputed above recheck_layer


# The config's repair fields a call may override (kvboost_core.call_options builds a call's RepairSpec from the
# config and these; the skins' per-call options are read from here): the one list of their names.
REPAIR_OPTIONS = ("repair", "recompute_ratio", "check_layer", "select", "reuse_repaired", "recompute_mass",
                  "query_tokens", "recheck_layer", "recheck_ratio")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    chunk_size: int = 128
    boundary_window: int = 16
    repair: str = "cacheblend"
    recompute_ratio: float = 0.15
    # adaptive CacheBlend: keep recomputing the top-scored tokens until they cover this share of the total
    # check-layer score (0: off, exactly recompute_ratio), between recompute_ratio and max_recompute_ratio
    recompute_mass: float = 0.0
    max_recompute_ratio: float = 1.0
    # query-aware CacheBlend: weight each token's deviation by the attention the last query_tokens prompt
    # tokens (the question and the template's tail) pay it at the check layer (0: off)
    query_tokens: int = 0
    check_layer: int = 1
    # progressive CacheBlend: at recheck_layer (> check_layer) re-score the tokens kept at check_layer and keep
    # recomputing only the top recheck_ratio of the candidates above it (None: one check layer)
    recheck_layer: int | None = None
    recheck_ratio: float = 0.0
    # measured on stories260K: beats plain deviation on story and QA workloads (see README)
    select: str = "deviation_recency"
    overlap_k: int = 16
    sink_tokens: int = 32
    kv_bits: int | None = None
    kv_group_size: int = 32  # KIVI group; 128 trades a little accuracy for fewer scale bytes
    max_cache_bytes: int = 2 * 1024**3
    namespace: str = "default"
    store: Any = "memory"
    store_prefix: bool = True
    # False (the default): KV from a repaired (approximate) prefill is never stored, so no request is served
    # another request's approximation and greedy output does not depend on request history. True stores it
    # under the prompt's prefix keys and serves it (counted as ``reused_repaired``, never as exact) to later
    # prompts with the same prefix: faster multi-turn reuse, but answers then depend on which request came first.
    store_repaired: bool = False
    # Exact history (kvboost_core.serving.backfill): after each generation, a background thread recomputes the prompt and
    # the generated tokens exactly while no request runs, and stores them as exact prefix entries, so a chat's next
    # turn reuses its whole history exactly (as prefix caching does after a full prefill) instead of repairing it
    # again. Costs one prefill of the approximate part per turn, off the request path. Needs store_prefix.
    # "auto" (the default): only after a generation whose prompt continues an earlier prompt of this engine (a
    # chat's second turn on; kvboost_core.serving.backfill.FollowUps), so one-shot questions never pay for it. True:
    # after every generation; False: never.
    backfill: bool | str = "auto"
    add_special_tokens: bool = True
    # None: the tokenizer's BOS (else EOS); "chat": the chat template's head before a user message (system turn
    # and user header); a str or a list of ids overrides
    warm_prefix: Any = None
    # Calibrate CacheBlend on this model's own warmed documents the first time enough are warmed (see
    # kvboost_core.tuning.autocalib): KVEngine.from_pretrained turns it on for models without a kvboost.json. The
    # search stops after calibration_budget_s seconds; the result is cached by model fingerprint.
    auto_calibrate: bool = False
    calibration_budget_s: float = 60.0
    # A reader adapter directory (``kvboost-rag adapt``): gated LoRA weights the tokens that read re-placed
    # document KV run through (kvboost_core.lora.reader). None: the base model only.
    reader_adapter: str | None = None
    # A block adapter directory (``kvboost-rag adapt --block``): LoRA weights merged into the model so that
    # documents served at repair="none" are that adapted model's own (block-attention) prefill
    # (kvboost_core.lora.block_adapter). None: the base model.
    block_adapter: str | None = None
    # The precision the linear layers' weights are held and read at (kvboost_core.model.weights): "fp32" as loaded,
    # or "fp16" packed for FBGEMM on the CPU (half the bytes per decoded token; fp32 activations). Applied to the
    # model in place when the engine is built; the stored KV's key includes it.
    weights: str = "fp32"
    extra: dict = field(default_factory=dict)
    # Deployment secret that authenticates disk/Redis entries (HMAC); None: env KVBOOST_STORE_SECRET or none.
    store_secret: str | bytes | None = field(default=None, repr=False)
    # The repair fields above as one value, built once here from the flat keywords callers write (and rebuilt by
    # ``with_``/``replace``): what every call that overrides none of them runs
    # (:func:`kvboost_core.call_options.repair_spec` adds a call's overrides).
    repair_spec: RepairSpec = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.chunk_size, int) or self.chunk_size < 1:
            raise ValueError(f"chunk_size must be a positive int, got {self.chunk_size!r}")
        if not isinstance(self.boundary_window, int) or not 0 <= self.boundary_window < self.chunk_size:
            raise ValueError(f"boundary_window must be in [0, chunk_size), got {self.boundary_window!r}")
        validate_repair(self.repair, self.recompute_ratio, self.select)
        validate_adaptive(self.recompute_mass, self.max_recompute_ratio, self.query_tokens)
        # The config does not know the model: a check_layer past its last layer is clamped to the last layer.
        # A per-call check_layer is checked against the model (validate_check_layer).
        validate_check_layer(self.check_layer, None)
        validate_recheck(self.recheck_layer, self.recheck_ratio, self.check_layer, None)
        if not isinstance(self.overlap_k, int) or self.overlap_k < 0:
            raise ValueError(f"overlap_k must be an int >= 0, got {self.overlap_k!r}")
        if not isinstance(self.sink_tokens, int) or self.sink_tokens < 0:
            raise ValueError(f"sink_tokens must be an int >= 0, got {self.sink_tokens!r}")
        if self.kv_bits not in (None, 4, 8, 16):
            raise ValueError(f"kv_bits must be None (model dtype), 16 (bf16), 8 or 4, got {self.kv_bits!r}")
        if not isinstance(self.kv_group_size, int) or self.kv_group_size < 1:
            raise ValueError(f"kv_group_size must be a positive int, got {self.kv_group_size!r}")
        if not isinstance(self.backfill, bool) and self.backfill != "auto":
            raise TypeError(f"backfill must be a bool or 'auto', got {self.backfill!r}")
        if not isinstance(self.auto_calibrate, bool):
            raise TypeError(f"auto_calibrate must be a bool, got {type(self.auto_calibrate).__name__}")
        if (isinstance(self.calibration_budget_s, bool) or not isinstance(self.calibration_budget_s, (int, float))
                or not self.calibration_budget_s > 0):
            raise ValueError(f"calibration_budget_s must be a number > 0, got {self.calibration_budget_s!r}")
        validate_namespace(self.namespace)
        if self.reader_adapter is not None and (not isinstance(self.reader_adapter, str) or not self.reader_adapter):
            raise TypeError(f"reader_adapter must be None or a directory path (str), got {self.reader_adapter!r}")
        if self.block_adapter is not None and (not isinstance(self.block_adapter, str) or not self.block_adapter):
            raise TypeError(f"block_adapter must be None or a directory path (str), got {self.block_adapter!r}")
        check_precision(self.weights)
        if self.block_adapter is not None and self.reader_adapter is not None:
            raise ValueError("block_adapter and reader_adapter cannot be combined: a block adapter already makes "
                             "re-placed documents the adapted model's own prefill")
        if self.reader_adapter is not None and self.store_repaired:
            raise ValueError("reader_adapter and store_repaired=True cannot be combined: KV computed through the "
                             "adapter must not be served to later prompts as their prefix")
        if self.store_secret is not None and (not isinstance(self.store_secret, (str, bytes))
                                              or not self.store_secret):
            raise ValueError("store_secret must be a non-empty str or bytes, or None")
        object.__setattr__(self, "max_cache_bytes", parse_bytes(self.max_cache_bytes))
        object.__setattr__(self, "repair_spec", RepairSpec(
            repair=self.repair, recompute_ratio=self.recompute_ratio, check_layer=self.check_layer,
            select=self.select, overlap_k=self.overlap_k, recompute_mass=self.recompute_mass,
            max_recompute_ratio=self.max_recompute_ratio, query_tokens=self.query_tokens,
            recheck_layer=self.recheck_layer, recheck_ratio=self.recheck_ratio))

    def with_(self, **changes: Any) -> EngineConfig:
        return replace(self, **changes)


def validate_repair(repair: str, ratio: float, select: str = "deviation") -> None:
    if not isinstance(repair, str) or repair not in REPAIRS:
        raise ValueError(f"repair must be one of {REPAIRS}, got {repair!r}")
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)):
        raise TypeError(f"recompute_ratio must be a float in [0, 1], got {type(ratio).__name__} {ratio!r}")
    if not 0.0 <= float(ratio) <= 1.0:  # NaN fails this too
        raise ValueError(f"recompute_ratio must be a float in [0, 1], got {ratio!r}")
    if not isinstance(select, str) or select not in SELECTS:
        raise ValueError(f"select must be one of {SELECTS}, got {select!r}")


def validate_adaptive(mass: float, max_ratio: float, query_tokens: int) -> None:
    for name, v in (("recompute_mass", mass), ("max_recompute_ratio", max_ratio)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 <= float(v) <= 1.0:
            raise ValueError(f"{name} must be a float in [0, 1], got {v!r}")
    if isinstance(query_tokens, bool) or not isinstance(query_tokens, int) or query_tokens < 0:
        raise ValueError(f"query_tokens must be an int >= 0, got {query_tokens!r}")


def validate_check_layer(check_layer: int, num_layers: int | None) -> None:
    """An int in [0, num_layers) (any int >= 0 when ``num_layers`` is None); a bool is not a layer."""
    if isinstance(check_layer, bool) or not isinstance(check_layer, int):
        raise TypeError(f"check_layer must be an int layer index, got {type(check_layer).__name__} "
                        f"{check_layer!r}")
    if check_layer < 0 or (num_layers is not None and check_layer >= num_layers):
        bound = "" if num_layers is None else f" and < {num_layers} (the model's layers)"
        raise ValueError(f"check_layer must be >= 0{bound}, got {check_layer!r}")


def validate_recheck(recheck_layer: int | None, recheck_ratio: float, check_layer: int,
                     num_layers: int | None) -> None:
    """None, or a layer after ``check_layer`` (and inside the model when ``num_layers`` is known); the ratio a
    float in [0, 1]."""
    if isinstance(recheck_ratio, bool) or not isinstance(recheck_ratio, (int, float)) \
            or not 0.0 <= float(recheck_ratio) <= 1.0:
        raise ValueError(f"recheck_ratio must be a float in [0, 1], got {recheck_ratio!r}")
    if recheck_layer is None:
        return
    if isinstance(recheck_layer, bool) or not isinstance(recheck_layer, int):
        raise TypeError(f"recheck_layer must be None or an int layer index, got {type(recheck_layer).__name__} "
                        f"{recheck_layer!r}")
    if recheck_layer <= check_layer or (num_layers is not None and recheck_layer >= num_layers):
        bound = "" if num_layers is None else f" and < {num_layers} (the model's layers)"
        raise ValueError(f"recheck_layer must be > check_layer ({check_layer}){bound}, got {recheck_layer!r}")


def validate_flag(name: str, value: object, allow_none: bool = True) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be {'None or ' if allow_none else ''}a bool, got {value!r}")
