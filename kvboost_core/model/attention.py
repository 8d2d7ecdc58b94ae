"""The model's attention as kvboost runs it: sparse query rows at their causal cost, and row-wise decode.

HF's decoder layers call the attention function registered under ``config._attn_implementation``. Within a
:func:`switched` block that name is ``"kvboost|<impl>"``, one wrapper per base implementation ("sdpa",
"eager") that looks at what it is given:

- a :class:`RowBlocks` mask (a planned forward's sparse rows, built once per forward by :func:`row_blocks`):
  the rows run in query blocks of ``block_rows``, each reading only the keys up to its last row's position
  (and from its first row's window start), with a float additive mask and grouped-query K/V passed natively
  (``enable_gqa``) instead of HF's ``repeat_kv`` copies. A dense (n, T) mask made every recomputed row read
  all T keys (about 1.4x a causal prefill's attention for 70% of the rows), SDPA converted the bool mask to
  float in every layer, and HF's sdpa path turned grouped-query attention off whenever a mask was passed.
- row lengths set by :func:`kvboost_core.serving.invariant.rowwise_attention` on this thread: one call per batch row on
  the row's own keys (batch-invariant decode, see that module);
- anything else (another thread using the same model, a plain HF forward): the base implementation as is.

One wrapper serves both, so a prefill on one thread and a deterministic decode step on another never fight
over the config's name. The switch is reference-counted per config: the name is restored when the last
block on any thread leaves.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

PREFIX = "kvboost|"  # registered name: this prefix + the model's own implementation ("sdpa", "eager")
BLOCK_ROWS = 256  # query rows per block (measured on SmolLM2's layout at 4K, 1 thread: see the report in #25)

# A block is cut in two where that saves at least this share of its (query, key) pairs (see _split).
SPLIT_GAIN = 0.125
SPLIT_MIN_PAIRS = 4096  # ... and at least this many: a kernel call costs about 250 pairs' work (1 thread)
_LOCAL = threading.local()  # .lengths: row lengths of a rowwise_attention block on this thread
_SWITCH_LOCK = threading.Lock()
_SWITCHED: dict[int, list[Any]] = {}  # id(config) -> [count, original name]


@dataclass(frozen=True, slots=True)
class QueryBlock:
    start: int  # rows [start, end) of the computed positions
    end: int
    k_lo: int  # keys [k_lo, k_hi) they read
    k_hi: int
    mask: torch.Tensor  # (1, 1, end - start, k_hi - k_lo) additive: 0 where allowed, -inf (eager: finfo.min) not


@dataclass(frozen=True, slots=True)
class RowBlocks:
    """A planned forward's attention for ``rows`` sparse query rows, split into causal query blocks."""

    rows: int
    blocks: tuple[QueryBlock, ...]


def base_impl(config: Any) -> str:
    """The model's own attention implementation, whether or not a kvboost block has switched the name."""
    impl = config._attn_implementation
    if isinstance(impl, str) and impl.startswith(PREFIX):
        with _SWITCH_LOCK:
            state = _SWITCHED.get(id(config))
        if state is not None:
            return str(state[1])
    return str(impl)


def visible(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """The one causal rule, as a bool matrix (r, K): a query at position p sees a key at k when k <= p (and
    k > p - window under a sliding window). Every mask of the package is built from it."""
    q, k = q_pos.view(-1, 1), k_pos.view(1, -1)
    allowed = k <= q
    if window is not None:
        allowed &= k > q - window
    return allowed


def additive(allowed: torch.Tensor, impl: str, dtype: torch.dtype) -> torch.Tensor:
    """``allowed`` as an additive float mask: 0 where visible, else -inf (SDPA; what it makes of a bool mask) or
    the dtype's minimum (eager, as the model's own masks)."""
    neg = float("-inf") if impl != "eager" else torch.finfo(dtype).min
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, neg)


def row_blocks(q_pos: torch.Tensor, length: int, window: int | None, *, impl: str, dtype: torch.dtype,
               block_rows: int | None = None, split_gain: float | None = None) -> RowBlocks:
    """Query blocks for sorted positions ``q_pos`` (n,) attending keys [0, length): a row at position p sees keys
    k <= p (and k > p - window). Each block of at most ``block_rows`` rows reads keys [first - window + 1,
    last + 1); a block is split further where that saves at least ``split_gain`` of its (query, key) pairs (see
    :func:`_split`). None: the module's ``BLOCK_ROWS`` / ``SPLIT_GAIN`` at call time (benchmarks and tests set them)."""
    block_rows = BLOCK_ROWS if block_rows is None else block_rows
    split_gain = SPLIT_GAIN if split_gain is None else split_gain
    if block_rows < 1:
        raise ValueError(f"block_rows must be >= 1, got {block_rows}")
    n = int(q_pos.numel())
    if n and int(q_pos[-1]) >= length:
        raise ValueError(f"a query position ({int(q_pos[-1])}) is past the attended length {length}")
    pos = q_pos.tolist()
    pos_np = np.asarray(pos, dtype=np.int64)
    spans: list[tuple[int, int]] = []
    for a in range(0, n, block_rows):
        spans.extend(_split(pos_np, a, min(a + block_rows, n), window, split_gain))
    blocks = []
    for a, b in spans:
        k_lo = 0 if window is None else max(0, pos[a] - window + 1)
        k_hi = pos[b - 1] + 1
        allowed = visible(q_pos[a:b], torch.arange(k_lo, k_hi, device=q_pos.device), window)  # (r, K)
        mask = additive(allowed, impl, dtype)
        blocks.append(QueryBlock(a, b, k_lo, k_hi, mask.view(1, 1, b - a, k_hi - k_lo)))
    return RowBlocks(n, tuple(blocks))


def _split(pos: np.ndarray, a: int, b: int, window: int | None, gain: float) -> list[tuple[int, int]]:
    """Rows [a, b) as one block, or cut in two where the cut saves the most (query, key) pairs, recursively,
    while a cut saves at least ``gain`` of the block's pairs and ``SPLIT_MIN_PAIRS``. Every row of a block reads the block's whole key
    span, so a large gap in the positions (the system prompt's rows and the question's in one block: the former
    read ~4K keys they mask) costs the gap once per row before it; a cut there costs one more kernel call."""
    if b - a < 2 or gain <= 0:
        return [(a, b)]
    p = pos[a:b]  # (r,) int64 sorted
    lo = np.zeros_like(p) if window is None else np.maximum(p - window + 1, 0)  # each row's first key
    r = b - a
    whole = r * (p[-1] + 1 - lo[0])
    i = np.arange(1, r)  # cut before local row i: rows [0, i) and [i, r)
    left = i * (p[i - 1] + 1 - lo[0])
    right = (r - i) * (p[-1] + 1 - lo[i])
    saved = whole - left - right  # (r - 1,)
    j = int(np.argmax(saved))
    if saved[j] < max(gain * whole, SPLIT_MIN_PAIRS, 1):
        return [(a, b)]
    cut = a + j + 1
    return _split(pos, a, cut, window, gain) + _split(pos, cut, b, window, gain)


def _base_attention(impl: str, module: torch.nn.Module) -> Callable[..., tuple[torch.Tensor, Any]]:
    """The function ``module`` runs for ``impl``: "eager" is each model family's own function (not in the
    registry: softcapping, scaling differ), anything else the registered one."""
    if impl == "eager":
        return sys.modules[type(module).__module__].eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS[impl]


def block_attention(impl: str, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                    value: torch.Tensor, plan: RowBlocks, **kwargs: Any) -> torch.Tensor:
    """query (1, H, n, D), key/value (1, H_kv, T, D) -> (1, n, H, D), HF's attention output layout."""
    if query.shape[0] != 1 or query.shape[2] != plan.rows:
        raise RuntimeError(f"row blocks planned for {plan.rows} rows got a query of shape {tuple(query.shape)}")
    h, d = query.shape[1], value.shape[-1]
    out = query.new_empty(1, plan.rows, h, d)  # (1, n, H, D)
    gqa = h != key.shape[1]
    base = None if impl == "sdpa" else _base_attention(impl, module)
    for blk in plan.blocks:
        q = query[:, :, blk.start:blk.end]  # (1, H, r, D)
        k = key[:, :, blk.k_lo:blk.k_hi]  # (1, H_kv, K, D): a view, no copy
        v = value[:, :, blk.k_lo:blk.k_hi]
        if base is None:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=blk.mask, scale=kwargs.get("scaling"),
                                               enable_gqa=gqa)  # (1, H, r, D)
            out[:, blk.start:blk.end] = o.transpose(1, 2)
        else:
            out[:, blk.start:blk.end] = base(module, q, k, v, blk.mask, **kwargs)[0]  # (1, r, H, D)
    return out


def _slice_rows(t: torch.Tensor | None, i: int, length: int) -> torch.Tensor | None:
    """Row ``i`` of a (rows, ..., T) mask limited to its first ``length`` keys (None stays None)."""
    return None if t is None else t[i:i + 1, ..., :length]


def _dispatch(impl: str) -> Callable[..., tuple[torch.Tensor, None]]:
    def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: Any, **kwargs: Any) -> tuple[torch.Tensor, None]:
        if isinstance(attention_mask, RowBlocks):
            return block_attention(impl, module, query, key, value, attention_mask, **kwargs), None
        base = _base_attention(impl, module)
        lengths: Sequence[int] | None = getattr(_LOCAL, "lengths", None)
        if lengths is None:
            return base(module, query, key, value, attention_mask, **kwargs)[0], None
        if len(lengths) != query.shape[0]:
            raise RuntimeError(f"row-wise attention was given {len(lengths)} lengths for {query.shape[0]} rows")
        outs = [base(module, query[i:i + 1], key[i:i + 1, :, :n], value[i:i + 1, :, :n],
                     _slice_rows(attention_mask, i, n), **kwargs)[0] for i, n in enumerate(lengths)]
        return torch.cat(outs), None

    return attention


def _registered(impl: str) -> str:
    """The name of ``impl``'s wrapper, registered on first use (with ``impl``'s mask builder, so a plain HF
    forward on another thread still gets its usual masks)."""
    name = PREFIX + impl
    if name not in ALL_ATTENTION_FUNCTIONS:
        if impl != "eager" and impl not in ALL_ATTENTION_FUNCTIONS:
            raise ValueError(f"no attention implementation {impl!r} to wrap")
        AttentionInterface.register(name, _dispatch(impl))
        if impl in ALL_MASK_ATTENTION_FUNCTIONS:
            ALL_MASK_ATTENTION_FUNCTIONS.register(name, ALL_MASK_ATTENTION_FUNCTIONS[impl])
    return name


@contextlib.contextmanager
def switched(config: Any) -> Iterator[str]:
    """Within the block, the model with ``config`` runs kvboost's attention wrapper; yields the base
    implementation's name. Nested and concurrent blocks share the switch; the last one out restores it."""
    with _SWITCH_LOCK:
        state = _SWITCHED.get(id(config))
        if state is None:
            impl = config._attn_implementation
            if not isinstance(impl, str) or impl.startswith(PREFIX):
                raise ValueError(f"config has attn_implementation={impl!r}; kvboost wraps a model's own one")
            config._attn_implementation = _registered(impl)
            state = _SWITCHED[id(config)] = [0, impl]
        state[0] += 1
        impl = state[1]
    try:
        yield impl
    finally:
        with _SWITCH_LOCK:
            state[0] -= 1
            if state[0] == 0:
                config._attn_implementation = state[1]  # the base, as :func:`use_base` may have changed it
                del _SWITCHED[id(config)]


def use_base(config: Any, allowed: Sequence[str], default: str) -> str:
    """Make the model's own attention implementation one of ``allowed`` (else ``default``); return it.

    Safe while a :func:`switched` block runs on another thread (an engine built on a model another engine is
    running): the config's name is then kvboost's wrapper, which must stay for that forward, so only the base the
    wrapper runs (and the last block out restores) changes, and only if it is not allowed already. Setting the
    name directly there would hand that forward's :class:`RowBlocks` to the plain implementation."""
    with _SWITCH_LOCK:
        state = _SWITCHED.get(id(config))
        base = state[1] if state is not None else getattr(config, "_attn_implementation", None)
        if base in allowed:
            return str(base)
        if state is None:
            config._attn_implementation = default
        else:
            state[1] = default
            config._attn_implementation = _registered(default)
        return default


@contextlib.contextmanager
def rows(lengths: Sequence[int]) -> Iterator[None]:
    """On this thread, within the block, batched attention runs once per row on its first ``lengths[i]`` keys."""
    _LOCAL.lengths = list(lengths)
    try:
        yield
    finally:
        _LOCAL.lengths = None
