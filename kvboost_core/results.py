"""Small immutable results returned at the engine's boundary, and the engine's counters."""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # annotations only: importing the results (e.g. langchain_kvboost) must not load torch
    import torch


@dataclass(slots=True)
class AssembledCache:
    """The prompt's KV after assembly and repair: per-layer buffers (1, H_kv, T_max, D), valid up to ``length``."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    length: int

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys[i][:, :, : self.length], self.values[i][:, :, : self.length]


@dataclass(slots=True)
class PrefillStats:
    """What one prefill reused, recomputed and computed, and what it took: the engine's typed record.

    The counts partition the prompt (``prompt_tokens`` = reused_* + recomputed + computed); read what a surface
    reports as "cached" through :func:`cache_counts`, never by summing these yourself. It also reads as a
    mapping (``stats["reused_exact"]``, ``dict(stats)``): the flat view the RAG layer and JSON reports extend."""

    prompt_tokens: int
    reused_exact: int  # served from an exact prefix entry
    reused_block: int  # re-placed documents that are a block adapter's own prefill (exact for that model)
    reused_approx: int  # re-placed documents kept without recompute: approximate
    reused_repaired: int  # an earlier repaired prefill's stored KV: approximate
    recomputed: int  # re-placed tokens the repair computed again
    computed: int  # tokens no cache entry held
    reuse_ratio: float  # (reused_exact + reused_block + reused_approx + reused_repaired) / prompt_tokens
    repair: str
    recompute_ratio: float
    select: str
    recheck_layer: int | None
    tokens_per_layer: list[int]  # tokens run through each layer
    hits_exact: int  # chunks found, per kind
    hits_repaired: int
    hits_content: int
    misses: int
    reader: bool = False  # a reader adapter gated the forward
    check_kv_tokens: int = 0  # tokens whose K/V the check layer computed for scoring only
    tokenize_s: float = 0.0
    lookup_s: float = 0.0
    assemble_s: float = 0.0
    forward_s: float = 0.0
    prefill_s: float = 0.0  # compute time of the prefill (the sum of the stages)
    canonical_prefix_tokens: int | None = None  # a canonical prefill's cut (kvboost_core.serving.canonical)
    chat_history_tokens: int | None = None  # a chat call's history (kvboost_core.engine.exact_history)

    def as_dict(self) -> dict[str, Any]:
        """The flat view: every field, None ones left out (a plain prefill has no canonical cut)."""
        return {k: v for k in self.__slots__ if (v := getattr(self, k)) is not None}  # type: ignore[attr-defined]

    # a read-only mapping view, so `stats["reused_exact"]`, `stats.get(...)` and `dict(stats)` keep working
    def __getitem__(self, key: str) -> Any:
        if key not in self.__slots__ or getattr(self, key) is None:  # type: ignore[attr-defined]
            raise KeyError(key)
        return getattr(self, key)

    def get(self, key: str, default: Any = None) -> Any:
        try:
            return self[key]
        except KeyError:
            return default

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and self.get(key) is not None

    def keys(self) -> list[str]:
        return list(self.as_dict())

    def items(self) -> list[tuple[str, Any]]:
        return list(self.as_dict().items())


@dataclass(frozen=True, slots=True)
class PrefillResult:
    """:meth:`KVEngine.prefill`'s output: the prompt's ids, the next-token logits, the assembled KV and what it
    cost (:class:`PrefillStats`)."""

    token_ids: list[int]
    last_logits: torch.Tensor  # (vocab,) fp32
    cache: AssembledCache
    stats: PrefillStats


@dataclass(frozen=True, slots=True)
class GenerationResult:
    """One generation's output and what it cost: :meth:`KVEngine.generate`'s return value (a stream's
    ``.result`` once it is exhausted). ``stats`` holds the prefill's counts and timings; read the cache counts
    through :func:`cache_counts`."""

    text: str  # the generated text, cut at the first stop string
    token_ids: list[int]  # generated ids only
    prompt_token_ids: list[int]  # the ids the model read, as a plain tokenizer gives them
    ttft_s: float  # from the call's start to the first token
    total_s: float  # from the call's start to the last token
    reuse_ratio: float  # share of the prompt served from cached KV, exact or approximate
    finish_reason: str  # "stop", "eos", "length"
    stats: dict[str, Any]
    first_logits: torch.Tensor | None = field(default=None, repr=False)  # (vocab,) fp32: the prefill's output


@dataclass(frozen=True, slots=True)
class CacheCounts:
    """Where a prompt's KV came from: the one definition of "cached tokens", which every surface reports (the
    server's ``usage`` and ``/metrics``, LangChain's ``usage_metadata``, LlamaIndex's ``additional_kwargs``, the
    per-call reports and :func:`kvboost_rag.doc_stats`). Build it with :func:`cache_counts`.

    The four counts partition the prompt (``cached + approximate + recomputed + computed == prompt_tokens``):

    - ``cached``: KV read from the cache and used as is, and exact: a prompt-prefix hit (``reused_exact``), or a
      re-placed document under a block adapter at ``repair="none"`` (``reused_block``: exactly that adapted
      model's own prefill). A reply with them equals one without: OpenAI's ``cached_tokens``, LangChain's
      ``cache_read``.
    - ``approximate``: KV read from the cache and used as is, but an approximation of the full prefill:
      re-placed document KV kept without recompute (``reused_approx``) and an earlier repaired prefill's KV
      (``reused_repaired``). It saves the same compute, and is never counted in ``cached``.
    - ``recomputed``: served from the cache, then recomputed (by repair, or the last token, whose logits are
      the output); ``computed``: no cache entry.

    ``replaced_cached`` and ``replaced_approximate`` are the re-placed document tokens within ``cached`` and
    ``approximate`` (``reused_block`` and ``reused_approx``); the rest of each is prompt-prefix KV.
    """

    prompt_tokens: int
    cached: int
    approximate: int
    recomputed: int
    computed: int
    replaced_cached: int = 0
    replaced_approximate: int = 0

    @property
    def reuse_ratio(self) -> float:
        """Share of the prompt served from the cache and used as is, exact or approximate (the engine's
        ``reuse_ratio``)."""
        return (self.cached + self.approximate) / self.prompt_tokens if self.prompt_tokens else 0.0


def cache_counts(stats: Mapping[str, Any] | PrefillStats | None) -> CacheCounts:
    """:class:`CacheCounts` of one prefill, from the engine's stats (``PrefillResult.stats``,
    ``GenerationResult.stats``); missing keys count 0."""
    s = stats or {}

    def n(key: str) -> int:
        return int(s.get(key, 0) or 0)

    block, approx, repaired = n("reused_block"), n("reused_approx"), n("reused_repaired")
    return CacheCounts(prompt_tokens=n("prompt_tokens"), cached=n("reused_exact") + block,
                       approximate=approx + repaired, recomputed=n("recomputed"), computed=n("computed"),
                       replaced_cached=block, replaced_approximate=approx)


@dataclass(frozen=True, slots=True)
class WarmResult:
    """What :meth:`KVEngine.warm` did: documents computed and stored now, found warm already, and the cost."""

    documents: int
    warmed: int  # documents computed now and stored whole
    already_warm: int  # documents whose chunks were all present: cost a lookup
    chunks: int  # chunks stored now
    tokens: int  # tokens of the documents counted in ``warmed``
    bytes: int
    seconds: float
    doc_token_ids: list[list[int]] = field(default_factory=list)
    not_stored: int = 0  # documents computed but not (wholly) stored: the budget held nothing it could evict


class Counters:
    """Thread-safe token counters for ``KVEngine.stats()``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # hits_repaired: prefix tokens served from earlier repaired (approximate) prefills, never counted exact
        self._c = {"hits_exact": 0, "hits_repaired": 0, "hits_content": 0, "misses": 0, "prefills": 0,
                   "warmed_tokens": 0}

    def add(self, **kw: int) -> None:
        with self._lock:
            for k, v in kw.items():
                self._c[k] = self._c.get(k, 0) + int(v)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._c)


def speedup_text(ttft_ratio: float) -> str:
    """A reuse / full TTFT ratio in the docs' wording (``kvboost_rag.app.fmt.speedup``'s): full / reuse as
    "N.NNx faster", or "N.NNx slower" when reuse took longer (it printed "0.86x faster"); "n/a" when unmeasured.
    The direction is decided on the printed digits, so equal-looking ratios never read "1.00x slower"."""
    if not (math.isfinite(ttft_ratio) and ttft_ratio > 0):
        return "n/a"
    faster = 1.0 / ttft_ratio
    if faster >= 1.0 or f"{ttft_ratio:.2f}" == "1.00":
        return f"{max(faster, 1.0):.2f}x faster"
    return f"{ttft_ratio:.2f}x slower"
