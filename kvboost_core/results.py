"""Small immutable results returned at the engine's boundary, and the engine's counters."""

from __future__ import annotations

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


@dataclass(frozen=True, slots=True)
class PrefillResult:
    token_ids: list[int]
    last_logits: torch.Tensor  # (vocab,) fp32
    cache: AssembledCache
    stats: dict[str, Any]


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


def cache_counts(stats: Mapping[str, Any] | None) -> CacheCounts:
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
