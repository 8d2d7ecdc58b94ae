"""JSON output enforced by constrained decoding (llguidance), for ``with_structured_output``.

Each step, the grammar compiled from the JSON schema says which tokens may come next; every other token's
logit is set to -inf before sampling, so the reply is valid JSON for the schema by construction (unless the
token budget runs out first: ``finish_reason == "length"``).

llguidance was picked over xgrammar, outlines-core and lm-format-enforcer for: CPU wheels with no build
step, no torch.compile or CUDA requirement, a JSON-schema compiler that takes the schema as is, and a mask
cost that is independent of the vocabulary's structure (~10-20 us per token measured on a 512-token
vocabulary; see the report). Only llguidance was measured here.

Decoding runs on the HF model with its own cache (a full prefill of the prompt): the engine's generate loop
has no logits hook yet, so structured calls do not reuse warmed KV. The minimal engine change that would let
them is a ``logits_processor`` argument applied to the logits before each ``sample`` call in
``KVEngine._run``.
"""

from __future__ import annotations

import json
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any

_TOKENIZERS: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def _ll_tokenizer(tokenizer: Any, n_vocab: int) -> Any:
    from kvboost_rag._lazy import require

    require("llguidance")
    import llguidance.hf

    with _LOCK:
        key = tokenizer
        cached = _TOKENIZERS.get(key)
        if cached is None or cached[0] != n_vocab:
            cached = (n_vocab, llguidance.hf.from_tokenizer(tokenizer, n_vocab=n_vocab))
            _TOKENIZERS[key] = cached
        return cached[1]


@dataclass(slots=True)
class StructuredResult:
    text: str
    token_ids: list[int]
    prompt_token_ids: list[int]
    finish_reason: str  # "stop" (the grammar is complete), "eos" or "length"
    ttft_s: float
    total_s: float
    mask_s: float  # time spent computing token masks

    @property
    def stats(self) -> dict[str, Any]:
        return {"finish_reason": self.finish_reason, "ttft_s": self.ttft_s, "reuse_ratio": 0.0,
                "mask_s": self.mask_s, "output_tokens": len(self.token_ids),
                "prompt_tokens": len(self.prompt_token_ids), "mode": "constrained"}


def closed_schema(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` on every object that lists properties and does not
    say otherwise: JSON-schema's default lets a model add keys until the token budget runs out, and pydantic
    schemas never say it."""
    if isinstance(schema, list):
        return [closed_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed_schema(v) for k, v in schema.items()}
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


class JsonConstraint:
    """The token mask of one JSON-schema-constrained generation."""

    def __init__(self, tokenizer: Any, n_vocab: int, schema: dict[str, Any] | None) -> None:
        import llguidance
        import llguidance.torch as lt

        if schema is not None and not isinstance(schema, dict):
            raise TypeError(f"schema must be a JSON schema dict, got {type(schema).__name__}")
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            json.dumps(closed_schema(schema) if schema is not None else {"type": "object"}),
            defaults={"whitespace_flexible": False})  # compact JSON: no run-away whitespace
        self.matcher = llguidance.LLMatcher(_ll_tokenizer(tokenizer, n_vocab), grammar)
        error = self.matcher.get_error()
        if error:
            raise ValueError(f"the JSON schema cannot be compiled to a grammar: {error}")
        self._lt = lt
        self._bits = lt.allocate_token_bitmask(1, n_vocab)
        self._n_vocab = n_vocab

    def mask_(self, logits: Any) -> Any:
        """Set the logits of disallowed tokens to -inf (in place) and return them."""
        import torch

        self._lt.fill_next_token_bitmask(self.matcher, self._bits, 0)
        words = self._bits[0].to(torch.int64) & 0xFFFFFFFF
        shifts = torch.arange(32, dtype=torch.int64)
        allowed = ((words.unsqueeze(1) >> shifts) & 1).flatten()[: self._n_vocab].bool().to(logits.device)
        n = min(logits.shape[-1], allowed.shape[0])
        logits[..., :n].masked_fill_(~allowed[:n], float("-inf"))
        if logits.shape[-1] > n:
            logits[..., n:] = float("-inf")
        return logits

    def consume(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            raise RuntimeError(f"the grammar rejected token {token}: {self.matcher.get_error()}")

    @property
    def done(self) -> bool:
        return bool(self.matcher.is_stopped())


def _eos_ids(model: Any, tokenizer: Any) -> set[int]:
    ids: set[int] = set()
    for src in (getattr(model, "generation_config", None), getattr(model, "config", None), tokenizer):
        value = getattr(src, "eos_token_id", None)
        ids.update([value] if isinstance(value, int) else [v for v in (value or []) if isinstance(v, int)])
    return ids


def generate_json(rag: Any, prompt: str, schema: dict[str, Any] | None, *, max_new_tokens: int = 256,
                  temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None,
                  add_special_tokens: bool = True) -> StructuredResult:
    """Generate a completion of ``prompt`` that is a JSON value of ``schema`` (None: any JSON object)."""
    import torch

    from kvboost_core.adapters import output_cache
    from kvboost_core.decode import SamplingParams, sample

    t0 = time.perf_counter()
    params = SamplingParams.create(max_new_tokens, temperature, top_p, None, seed)
    engine = rag.engine
    model = engine.model
    n_vocab = int(model.config.vocab_size)
    constraint = JsonConstraint(rag.tokenizer, n_vocab, schema)
    ids = rag.encode(prompt, add_special_tokens)
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
    eos = _eos_ids(model, rag.tokenizer)
    out_ids: list[int] = []
    finish, ttft, mask_s = "length", 0.0, 0.0
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([ids], device=device), use_cache=True)
        cache = output_cache(out)
        logits = out.logits[0, -1].float()
        for _ in range(params.max_new_tokens):
            t = time.perf_counter()
            constraint.mask_(logits)
            mask_s += time.perf_counter() - t
            token = sample(logits, params, generator)
            if not out_ids:
                ttft = time.perf_counter() - t0
            if token in eos:
                finish = "eos"
                break
            t = time.perf_counter()
            constraint.consume(token)
            mask_s += time.perf_counter() - t
            out_ids.append(token)
            if constraint.done:
                finish = "stop"
                break
            out = model(input_ids=torch.tensor([[token]], device=device), cache=cache, use_cache=True)
            cache = output_cache(out)
            logits = out.logits[0, -1].float()
    text = rag.tokenizer.decode(out_ids, skip_special_tokens=True)
    return StructuredResult(text, out_ids, list(ids), finish, ttft, time.perf_counter() - t0, mask_s)
