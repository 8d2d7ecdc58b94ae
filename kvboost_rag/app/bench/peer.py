"""The PyPI package ``kvboost`` (0.9.0, an unrelated project) as an optional peer method of bench workload A.

Install it with ``pip install 'kvboost-rag[bench]'``; without it the method is skipped and the JSON says so.

What its API does and what we measure instead (line numbers: kvboost 0.9.0's ``engine.py``):

* It takes text: ``generate(prompt)`` (386) tokenizes with ``encode(text, add_special_tokens=True)`` (1129),
  splits the ids into fixed ``chunk_size`` slices from position 0, reuses a contiguous run of cached slices
  from the start (exact prefix-chain hash, else a content-hash "approximate" hit). Warmed documents are found
  only when they start on a chunk boundary, so the preamble (lead + system tokens) and the documents are whole
  multiples of the chunk size we give it (``peer_chunk_size``): 32 with the default 32-token preamble, its own
  default 128 with ``--system-tokens 128`` (it never caches a slice under 32 tokens).
* Its modes are ``GenerationMode`` baseline / prefix_cache / chunk_kv_reuse; the repair is an engine setting,
  ``recompute_strategy`` selective / cacheblend / none. An approximate hit forces its CacheBlend pass anyway.
  We run ``chunk_kv_reuse`` with ``recompute_strategy="cacheblend"`` and our engine's recompute ratio.
* Its reported ``ttft_ms`` starts in ``_decode_with_kv`` (912), after assembly and the CacheBlend pass
  (874-878; its first step is a forward over every cached token), so the repair is off its clock. We time from
  the call's start to its ``on_token`` callback for the first token (958; tokenization, lookup, repair and the
  tail's forward included, its post-token bookkeeping excluded) and keep its own figure as
  ``reported_ttft_median_s``.
* ``cacheable_prefix_len=0`` keeps it from storing each query's chunks, as ``store_prefix=False`` does for
  ours: both reuse only what was warmed once at ingestion, and the exact prompt is never pre-warmed.

Shim (ours; the package's files are untouched): when the tokenizer prepends a BOS, the peer's ``warm(doc)``
would encode ``BOS + doc`` at position 0, so no chunk of a document could line up with the prompt and it would
reuse nothing but the preamble. We hand it the same tokenizer behind a proxy whose ``encode`` does not add
special tokens, and put the BOS in the prompt text (``"<s>" + ...``, parsed back to the BOS id), so the model
sees exactly our prompt and the peer warms documents as it would with a tokenizer without BOS (e.g. Qwen's).
Each prompt's text is checked to re-tokenize to our ids before it is timed.
"""

from __future__ import annotations

import math
import statistics
import time
import warnings
from typing import Any, cast

import torch

SKIP_REASON = "kvboost not installed (pip install 'kvboost-rag[bench]')"
PEER_DEFAULT_CHUNK = 128  # kvboost's own default chunk_size


def peer_chunk_size(preamble_tokens: int, doc_tokens: int) -> int:
    """The largest chunk size up to the peer's default that both the preamble and each document fill whole."""
    g = math.gcd(preamble_tokens, doc_tokens)
    return max(d for d in range(1, min(g, PEER_DEFAULT_CHUNK) + 1) if g % d == 0)


class _NoLeadTokenizer:
    """The shared tokenizer, except that ``encode`` never adds special tokens (see the module docstring)."""

    def __init__(self, tok: Any) -> None:
        self._tok = tok

    def encode(self, text: str, add_special_tokens: bool = True, **kw: Any) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False, **kw))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tok, name)

    def __len__(self) -> int:
        return len(self._tok)


class Peer:
    """kvboost's engine on our model object (same weights, dtype and device) and tokenizer."""

    def __init__(self, model: Any, tokenizer: Any, lead: list[int], chunk_size: int, recompute_ratio: float,
                 max_cache_bytes: int) -> None:
        from importlib.metadata import version

        from kvboost import GenerationMode, KVBoost, RecomputeStrategy

        self.version = version("kvboost")
        self.name = f"kvboost-{self.version}"
        self.tokenizer = tokenizer
        self.lead_text = tokenizer.decode(lead) if lead else ""
        self.peer_tok = cast(Any, _NoLeadTokenizer(tokenizer) if lead else tokenizer)
        self.mode = GenerationMode.CHUNK_KV_REUSE
        device = str(next(model.parameters()).device)  # its default would move our model to cuda, if any
        self.engine = KVBoost(model=model, tokenizer=self.peer_tok, max_cache_bytes=int(max_cache_bytes),
                              chunk_size=chunk_size, recompute_strategy=RecomputeStrategy.CACHEBLEND,
                              recompute_ratio=recompute_ratio, device=device)
        self.info: dict[str, Any] = {
            "method": self.name, "version": self.version,
            "api": "KVBoost(model, tokenizer, max_cache_bytes=...)",
            "mode": self.mode.value, "recompute_strategy": "cacheblend", "recompute_ratio": recompute_ratio,
            "chunk_size": chunk_size, "default_chunk_size": PEER_DEFAULT_CHUNK, "device": device,
            "tokenizer_shim": "encode() adds no special tokens; BOS is in the prompt text" if lead else None,
            "min_chunk_tokens": self.engine.chunk_registry.min_chunk_tokens,  # shorter ones are never cached
            "timing": "ours: call start to its on_token callback for the first token (max_new_tokens=1); "
                      "reported_ttft_median_s is its own ttft_ms, which excludes assembly and CacheBlend",
        }

    def text(self, pieces: list[list[int]]) -> str:
        return self.lead_text + "".join(self.tokenizer.decode(p) for p in pieces)

    def warm(self, preamble: list[int], docs: list[list[int]]) -> None:
        t0 = time.perf_counter()
        self.engine.warm(self.text([preamble]))  # its docs: warm the system prompt too, or nothing is reused
        t1 = time.perf_counter()
        for d in docs:
            self.engine.warm(self.tokenizer.decode(d))
        self.info.update(warm_preamble_s=t1 - t0, warm_s=time.perf_counter() - t1,
                         cache_after_warm=self.engine.cache_stats())

    def first_token(self, text: str, ids: list[int]) -> dict[str, Any]:
        t_enc = time.perf_counter()
        peer_ids = self.peer_tok.encode(text, add_special_tokens=True)  # off the clock: the same-prompt check
        tokenize_s = time.perf_counter() - t_enc
        if peer_ids != ids:
            raise ValueError(f"prompt text does not re-tokenize to our ids ({len(peer_ids)} vs {len(ids)})")
        firsts: list[float] = []
        stamp = lambda _tok: firsts.append(time.perf_counter())  # noqa: E731
        t0 = time.perf_counter()
        res = self.engine.generate(text, max_new_tokens=1, mode=self.mode, do_sample=False,
                                   cacheable_prefix_len=0, on_token=stamp)
        call_s = time.perf_counter() - t0
        if not firsts:
            raise RuntimeError("kvboost produced no first token")
        return {"ttft_s": firsts[0] - t0, "reuse": float(res.kv_reuse_ratio), "call_s": call_s,
                "reported_ttft_s": res.ttft_ms / 1000, "tokenize_s": tokenize_s,
                "cached_tokens": float(res.cached_tokens), "logits": torch.from_numpy(res.first_token_logits)}

    def finish(self) -> dict[str, Any]:
        self.info["cache_stats"] = self.engine.cache_stats()
        return self.info


def summarize(xs: list[dict[str, Any]]) -> dict[str, Any]:
    """The peer-only fields of a size's summary (the shared ones are filled in by the workload)."""
    return {"reported_ttft_median_s": statistics.median(x["reported_ttft_s"] for x in xs),
            "call_median_s": statistics.median(x["call_s"] for x in xs),
            "tokenize_median_s": statistics.median(x["tokenize_s"] for x in xs),
            "cached_tokens_mean": statistics.fmean(x["cached_tokens"] for x in xs)}


def load_peer(model: Any, tokenizer: Any, lead: list[int], chunk_size: int, recompute_ratio: float,
              max_cache_bytes: int) -> tuple[Peer | None, str | dict[str, Any]]:
    """(the peer, its JSON entry); (None, the skip reason or ``{"error": ...}``) when it cannot run."""
    try:
        with warnings.catch_warnings():  # its import probes the deprecated torch.backends.cuda.sdp_kernel
            warnings.simplefilter("ignore", FutureWarning)
            import kvboost  # noqa: F401
    except ImportError as exc:
        if exc.name == "kvboost":
            return None, SKIP_REASON
        return None, {"error": f"import kvboost: {type(exc).__name__}: {exc}"}
    try:
        peer = Peer(model, tokenizer, lead, chunk_size, recompute_ratio, max_cache_bytes)
    except Exception as exc:  # its failure is a result to report, not a reason to stop our benchmark
        return None, {"error": f"KVBoost(...): {type(exc).__name__}: {exc}"}
    return peer, peer.info
