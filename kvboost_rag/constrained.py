"""JSON output enforced by constrained decoding (llguidance), for ``with_structured_output``.

Each step, the grammar compiled from the JSON schema says which tokens may come next; every other token's
logit is set to -inf before sampling, so the reply is valid JSON for the schema by construction (unless the
token budget runs out first: ``finish_reason == "length"``).

Why llguidance. benchmarks/bench_grammar.py measured the four libraries the issue names, all installed from
CPU wheels against torch 2.13 (``OMP_NUM_THREADS=1 python benchmarks/bench_grammar.py``; results in
benchmarks/results/grammar.json and grammar.png), on the SmolLM2-135M-Instruct tokenizer (49152 tokens), forcing
a fixed compact JSON instance of three schemas (flat; nested objects with an array and enums; pattern, number
bounds, anyOf/null, date format) through each matcher, one thread on two shared cores. All four accepted all
three schemas and every forced token. Per token (mean mask + advance) and per schema compile:

- llguidance 1.9.1: 39-93 us per token (mask p50 10-17 us, p99 76-547 us), compile <1 ms; no dependencies.
- xgrammar 0.2.9: 5-13 us per token (p50 1-2 us, p99 8-18 us), compile 9-23 ms; but it requires torch,
  transformers, triton (about 1 GB installed) and apache-tvm-ffi, and its compact-JSON mode needs
  ``separators=(",", ":")`` (its default with any_whitespace=False is ", " / ": ").
- outlines-core 0.2.14: 121-629 us per token (the mask is a lookup, advancing the guide is the cost), compile
  62-655 ms (a DFA over the vocabulary per schema); its ``Vocabulary.from_pretrained`` needs the Hub.
- lm-format-enforcer 0.11.3: 0.76-1.07 ms per token, p99 5-14 ms; its transformers integration does not
  import under transformers 5 (measured through its core API).

A SmolLM2-135M decode step took 121 ms on the same machine (fp32, one thread), so both llguidance and xgrammar
cost under 0.1% of a step. Every structured call compiles its own schema, so per call (compile + tokens) a
40-token reply costs about 2.5 ms with llguidance against about 15 ms with xgrammar, which only wins past a
few hundred tokens; that, and no dependencies against about 1 GB of them, decided it. (One-time tokenizer
preparation, cached per tokenizer: llguidance 4.0 s, xgrammar 0.35 s.)

Decoding runs through ``KVEngine.generate`` like a plain call: :class:`JsonConstraint` is the engine's
``logits_processor``, so warmed documents in the prompt are reused (transparently, with the call's repair
strategy) and the stats report the real ``reuse_ratio``. When the JSON value is complete the constraint raises
``StopGeneration`` (``finish_reason == "stop"``); that costs one decode step whose logits are discarded, since
the engine asks the processor only before sampling. With ``repair="full"`` the tokens equal those of a plain
HF full prefill decoded with the same masks (tests/test_constrained_engine.py).
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from kvboost_rag.json_schema import closed_schema

if TYPE_CHECKING:
    from kvboost_core import GenerationResult

_TOKENIZERS: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


GRAMMAR_HINT = ("pip install 'kvboost-rag[langchain]' (or [llamaindex] or [structured], which include it; "
                "or pip install llguidance)")


def require_grammar(feature: str) -> None:
    """ImportError with the install hint unless llguidance (the grammar engine) is importable. The
    integrations call it when a forced tool call or structured output is bound, so a missing install fails
    there rather than at the first call."""
    try:
        import llguidance  # noqa: F401
    except ImportError as exc:
        raise ImportError(f"{feature} is decoded under a grammar, which needs llguidance; install it with "
                          f"`{GRAMMAR_HINT}`") from exc


def _ll_tokenizer(tokenizer: Any, n_vocab: int) -> Any:
    require_grammar("constrained decoding")
    import llguidance.hf

    with _LOCK:
        key = tokenizer
        cached = _TOKENIZERS.get(key)
        if cached is None or cached[0] != n_vocab:
            cached = (n_vocab, llguidance.hf.from_tokenizer(tokenizer, n_vocab=n_vocab))
            _TOKENIZERS[key] = cached
        return cached[1]


_TABLES: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
_CLOSERS = frozenset('"}]')


def _token_table(tokenizer: Any, n_vocab: int) -> tuple[Any, Any, Any, Any]:
    """(quote, closing, comma, length) over the vocabulary, cached per tokenizer: tokens made only of ``"``,
    ``}`` and ``]`` (``quote``: those starting with ``"``); tokens starting with ``,``; each token's text
    length."""
    import torch

    with _LOCK:
        cached = _TABLES.get(tokenizer)
        if cached is not None and cached[0] == n_vocab:
            return cached[1]
    texts = tokenizer.batch_decode([[i] for i in range(min(n_vocab, len(tokenizer)))])
    texts += [""] * (n_vocab - len(texts))
    closing = torch.tensor([bool(t) and set(t) <= _CLOSERS for t in texts])
    table = (closing & torch.tensor([t.startswith('"') for t in texts]), closing,
             torch.tensor([t.startswith(",") for t in texts]), torch.tensor([len(t) for t in texts]))
    with _LOCK:
        _TABLES[tokenizer] = (n_vocab, table)
    return table


class JsonConstraint:
    """The token mask of one JSON-schema-constrained generation, as a ``KVEngine`` logits processor:
    ``constraint(generated_ids, logits)`` feeds the ids the engine sampled since the last call to the
    grammar, then sets the logits of every token the grammar forbids next to -inf (in place). Once the JSON
    value is complete it raises ``StopGeneration``. One instance serves one generation.

    With ``budget`` (the generation's max_new_tokens), the JSON is also closed in time: once the tokens left
    come within ``CLOSE_MARGIN`` of the shortest way to finish the value from where it stands (closing the
    open string, the remaining required keys, then the open brackets: found by running the grammar on a
    copy), each next token is that way's next token. A model that loops inside a string still ends with valid
    JSON, unless the budget is below what the schema needs at all."""

    CLOSE_MARGIN = 8  # tokens of slack: one free token may open something (an optional key) that costs more
    CLOSE_HORIZON = 64  # longest closing path looked for (a deeper one: no closing, as before)

    def __init__(self, tokenizer: Any, n_vocab: int, schema: dict[str, Any] | None,
                 budget: int | None = None, *, lark: str | None = None) -> None:
        require_grammar("constrained decoding")
        import llguidance
        import llguidance.torch as lt

        if schema is not None and not isinstance(schema, dict):
            raise TypeError(f"schema must be a JSON schema dict, got {type(schema).__name__}")
        if lark is not None:  # a Lark grammar embedding JSON (%json), e.g. several tool-call blocks
            if not isinstance(lark, str) or schema is not None:
                raise TypeError("lark must be a Lark grammar str, given instead of a schema (schema=None)")
            grammar = llguidance.LLMatcher.grammar_from_lark(lark)
        else:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(
                json.dumps(closed_schema(schema) if schema is not None else {"type": "object"}),
                defaults={"whitespace_flexible": False})  # compact JSON: no run-away whitespace
        self.matcher = llguidance.LLMatcher(_ll_tokenizer(tokenizer, n_vocab), grammar)
        error = self.matcher.get_error()
        if error:
            raise ValueError(f"the JSON schema cannot be compiled to a grammar: {error}")
        self._lt = lt
        self._bits = lt.allocate_token_bitmask(1, n_vocab)  # (1, ceil(V / 32)) int32, one bit per token
        self._n_vocab = n_vocab
        self._consumed = 0  # how many of the generated ids the matcher has seen
        self.mask_s = 0.0  # time spent in the grammar (masks and consuming tokens)
        if budget is not None and (not isinstance(budget, int) or budget < 1):
            raise ValueError(f"budget must be a positive int (max_new_tokens) or None, got {budget!r}")
        self._budget = budget
        self._table = _token_table(tokenizer, n_vocab) if budget is not None else None
        self.closing_forced = 0  # tokens chosen by the closing path (budget running out)

    def __call__(self, generated_ids: list[int], logits: Any) -> Any:
        import torch

        from kvboost_core import StopGeneration

        t = time.perf_counter()
        try:
            for token in generated_ids[self._consumed:]:
                self.consume(token)
            self._consumed = len(generated_ids)
            if self.done:
                raise StopGeneration
            left = None if self._budget is None else self._budget - len(generated_ids)  # this one included
            if left is not None and left <= self.CLOSE_HORIZON + self.CLOSE_MARGIN:
                path = self.closing_path()
                if path and left <= len(path) + self.CLOSE_MARGIN:
                    self.closing_forced += 1
                    keep = logits[..., path[0]].clone()
                    logits.fill_(float("-inf"))
                    logits[..., path[0]] = torch.where(torch.isfinite(keep), keep, torch.zeros_like(keep))
                    return logits
            return self.mask_(logits)
        finally:
            self.mask_s += time.perf_counter() - t

    def _allowed(self, matcher: Any) -> Any:
        """(V,) bool: the tokens ``matcher`` allows next."""
        import torch

        self._lt.fill_next_token_bitmask(matcher, self._bits, 0)
        words = self._bits[0].to(torch.int64) & 0xFFFFFFFF  # (ceil(V / 32),) unsigned 32-bit words
        shifts = torch.arange(32, dtype=torch.int64)
        return ((words.unsqueeze(1) >> shifts) & 1).flatten()[: self._n_vocab].bool()

    def closing_path(self) -> list[int] | None:
        """The tokens that finish the JSON value soonest from here, by a greedy policy on a copy of the
        grammar: a token of only closing characters (``"``, ``}``, ``]``; the longest, those starting with ``"``
        first, since inside a string ``}`` is text) when allowed, else one starting with ``,`` (ending a number
        before the next required key), else the longest allowed token (the forced text of a key). None when it takes more than ``CLOSE_HORIZON`` tokens."""
        import torch

        assert self._table is not None
        quote, closing, comma, length = self._table
        m = self.matcher.deep_copy()
        path: list[int] = []
        while not (m.is_accepting() or m.is_stopped()):
            if len(path) >= self.CLOSE_HORIZON:
                return None
            allowed = self._allowed(m)
            for tier in (allowed & quote, allowed & closing, allowed & comma, allowed):
                if bool(tier.any()):
                    token = int(torch.where(tier, length, -1).argmax())
                    break
            else:
                return None
            if not m.consume_token(token):
                return None
            path.append(token)
        return path

    def mask_(self, logits: Any) -> Any:
        """Set the logits (..., V) of disallowed tokens to -inf (in place) and return them."""
        allowed = self._allowed(self.matcher).to(logits.device)
        n = min(logits.shape[-1], allowed.shape[0])
        logits[..., :n].masked_fill_(~allowed[:n], float("-inf"))
        if logits.shape[-1] > n:  # padded logits past the tokenizer's vocabulary: never allowed
            logits[..., n:] = float("-inf")
        return logits

    def consume(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            raise RuntimeError(f"the grammar rejected token {token}: {self.matcher.get_error()}")

    @property
    def done(self) -> bool:
        return bool(self.matcher.is_stopped())

    def complete(self, generated_ids: list[int]) -> bool:
        """Whether ``generated_ids`` (the whole generation) form a complete value: the engine does not ask the
        processor after the budget's last token, so that token is fed here."""
        try:
            for token in generated_ids[self._consumed:]:
                self.consume(token)
        except RuntimeError:
            return False
        self._consumed = len(generated_ids)
        return bool(self.matcher.is_accepting() or self.matcher.is_stopped())


def _json_constraint(rag: Any, schema: dict[str, Any] | None, max_new_tokens: int,
                     lark: str | None = None) -> JsonConstraint:
    return JsonConstraint(rag.tokenizer, int(rag.engine.model.config.vocab_size), schema, budget=max_new_tokens,
                          lark=lark)


def _finished(result: GenerationResult, constraint: JsonConstraint) -> GenerationResult:
    """The result with the constraint's stats, and "stop" when the budget's last token finished the value."""
    result.stats.update(constrained=True, mask_s=constraint.mask_s, closing_forced=constraint.closing_forced)
    if result.finish_reason == "length" and constraint.complete(list(result.token_ids)):
        result = _stopped(result)
    return result


def _stopped(result: GenerationResult, **changes: Any) -> GenerationResult:
    """``result`` finished by "stop", in its stats too (callers report the stats' finish_reason)."""
    result.stats["finish_reason"] = "stop"
    return dataclasses.replace(result, finish_reason="stop", **changes)


def generate_json(rag: Any, prompt: str, schema: dict[str, Any] | None, *, max_new_tokens: int = 256,
                  temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None,
                  stop: Any = None, lark: str | None = None, **engine_kw: Any) -> GenerationResult:
    """Generate a completion of ``prompt`` that is a JSON value of ``schema`` (None: any JSON object; or,
    with ``lark``, a text of that Lark grammar, whose JSON parts are closed in time the same way).

    It runs through ``rag.generate`` like a plain call (warmed documents in the prompt are reused; ``engine_kw``
    such as ``repair`` or ``add_special_tokens`` go to the engine), with a :class:`JsonConstraint` as the
    engine's logits processor, which closes the JSON before ``max_new_tokens`` runs out (see
    :class:`JsonConstraint`). ``stop`` strings are ignored: cutting the JSON short would break it. The
    result's stats add ``constrained`` (True), ``mask_s`` (time spent in the grammar) and ``closing_forced``
    (tokens chosen to close the JSON in time); ``finish_reason`` is "stop" whenever the JSON is complete."""
    del stop
    constraint = _json_constraint(rag, schema, max_new_tokens, lark)
    result = rag.generate(prompt, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed,
                          logits_processor=constraint, **engine_kw)
    return _finished(result, constraint)


def stream_json(rag: Any, prompt: str, schema: dict[str, Any] | None, *, max_new_tokens: int = 256,
                temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None, stop: Any = None,
                on_result: Any = None, **engine_kw: Any) -> Iterator[str]:
    """:func:`generate_json` streamed through ``rag.stream``: yields the text pieces of the constrained JSON;
    ``on_result(result, stats)`` gets the finished result (its ``finish_reason`` fixed as generate_json's).
    The grammar is compiled now, so a bad schema fails here rather than at the first ``next``."""
    del stop
    constraint = _json_constraint(rag, schema, max_new_tokens)

    def finished(result: GenerationResult, stats: dict[str, Any]) -> None:
        result = _finished(result, constraint)  # result.stats is stats: updated in place
        if on_result is not None:
            on_result(result, stats)

    return rag.stream(prompt, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed,
                      logits_processor=constraint, on_result=finished, **engine_kw)


def generate_tool_call(rag: Any, prompt: str, tools: list[dict[str, Any]], name: str | None = None, *,
                       calls: int = 1, **kw: Any) -> tuple[GenerationResult, str]:
    """A forced tool call (``tool_choice`` "any"/"required" or a tool's name): the prompt (a rendered chat
    prompt ending with the assistant's generation prompt) gets ``<tool_call>\\n`` appended, and the reply is
    constrained to ``{"name": <one of tools, or name>, "arguments": <that tool's parameter schema>}``; with
    ``calls`` > 1 (parallel calls allowed) to 1..``calls`` such blocks
    (:func:`kvboost_rag.toolcalls.tool_calls_grammar`), the model choosing how many.
    Returns (the result, the reply as the model wrote it: ``<tool_call>\\n{json}``...), which
    :func:`kvboost_rag.toolcalls.parse_tool_call_blocks` parses into valid calls unless ``finish_reason`` is
    "length" (the token budget cut the JSON; with several blocks, a cut last block is dropped and the reply
    ends at the last complete one, ``stats["calls_dropped"] == 1``)."""
    from kvboost_rag.toolcalls import TOOL_CALL_START, complete_calls, tool_call_schema, tool_calls_grammar

    if not isinstance(prompt, str):
        raise TypeError(f"prompt must be a str, got {type(prompt).__name__}")
    if calls == 1:  # one call: the call's JSON schema itself, as before parallel calls existed
        result = generate_json(rag, prompt + TOOL_CALL_START, tool_call_schema(tools, name), **kw)
        return result, TOOL_CALL_START + result.text
    result = generate_json(rag, prompt + TOOL_CALL_START, None, lark=tool_calls_grammar(tools, name, calls), **kw)
    if result.finish_reason == "length":
        # The budget ran out inside a later block: the blocks before it are complete calls; keep those.
        kept = complete_calls(result.text)
        if kept is not None:
            result.stats["calls_dropped"] = kept[1]
            result = _stopped(result, text=kept[0])
    return result, TOOL_CALL_START + result.text
