"""Grammar libraries for constrained JSON decoding, side by side: llguidance, xgrammar, outlines-core and
lm-format-enforcer on the SmolLM2-135M-Instruct tokenizer (vocabulary 49152).

    OMP_NUM_THREADS=1 python benchmarks/bench_grammar.py --json benchmarks/results/grammar.json \
        --png benchmarks/results/grammar.png

For each library that imports here and each JSON schema (flat; nested with an array of objects and enums;
string pattern, number bounds, anyOf/null and a date format) it measures:
- ``tokenizer_setup_s``: the one-time preprocessing of the tokenizer (shared by every schema);
- ``compile_s``: compiling the schema to a grammar/index for that tokenizer (median of ``--compiles``);
- ``mask_us`` mean/p50/p99: computing the next-token mask (a bitmask, or lm-format-enforcer's allowed-token
  list) at every step while a fixed valid compact JSON instance, tokenized by the tokenizer, is forced through
  the matcher, ``--runs`` times with a fresh matcher (the EOS step after the JSON included);
- ``advance_us`` mean: feeding the sampled token to the matcher;
- ``accepts``: the schema compiled, every forced token was allowed by the mask and EOS was allowed at the end.

Libraries that are absent are recorded as such (with the import error), never installed by this script; none
of them is a project dependency except llguidance. Timings are single-threaded on whatever CPU runs this
(two shared cores when the figures in kvboost_rag/constrained.py were taken), so compare them relatively.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SCHEMAS: dict[str, tuple[dict[str, Any], Any]] = {
    "flat": ({"type": "object", "properties": {
        "name": {"type": "string"}, "age": {"type": "integer"}, "email": {"type": "string"},
        "active": {"type": "boolean"}},
        "required": ["name", "age", "email", "active"], "additionalProperties": False},
        {"name": "Alice Smith", "age": 34, "email": "alice.smith@example.com", "active": True}),
    "nested": ({"type": "object", "properties": {
        "order_id": {"type": "integer"},
        "customer": {"type": "object", "properties": {
            "name": {"type": "string"}, "tier": {"enum": ["free", "pro", "enterprise"]}},
            "required": ["name", "tier"], "additionalProperties": False},
        "items": {"type": "array", "minItems": 1, "items": {"type": "object", "properties": {
            "sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1}, "price": {"type": "number"}},
            "required": ["sku", "qty", "price"], "additionalProperties": False}},
        "status": {"enum": ["pending", "shipped", "delivered"]}},
        "required": ["order_id", "customer", "items", "status"], "additionalProperties": False},
        {"order_id": 91827, "customer": {"name": "Bruno Keller", "tier": "pro"},
         "items": [{"sku": "KB-1042", "qty": 2, "price": 19.5}, {"sku": "MS-77", "qty": 1, "price": 8.25},
                   {"sku": "HD-2000", "qty": 3, "price": 129.0}], "status": "shipped"}),
    "constrained": ({"type": "object", "properties": {
        "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
        "note": {"anyOf": [{"type": "string"}, {"type": "null"}]},
        "date": {"type": "string", "format": "date"}},
        "required": ["code", "score", "tags", "note", "date"], "additionalProperties": False},
        {"code": "ABC-1234", "score": 0.75, "tags": ["alpha", "beta"], "note": None, "date": "2024-05-17"}),
}


def _bit(mask_row: Any, token: int) -> bool:
    return bool((int(mask_row[token // 32]) >> (token % 32)) & 1)


class Lib:
    """One grammar library behind a common face: setup(tokenizer) once, compile(schema) per schema,
    matcher(compiled) per run, then mask()/allowed(token)/advance(token) per step."""
    name = ""
    package = ""

    def setup(self, tok: Any, vocab: int) -> None:
        raise NotImplementedError

    def compile(self, schema: dict[str, Any]) -> Any:
        raise NotImplementedError

    def matcher(self, compiled: Any) -> Any:
        raise NotImplementedError

    def mask(self, m: Any) -> None:
        raise NotImplementedError

    def allowed(self, m: Any, token: int) -> bool:
        raise NotImplementedError

    def advance(self, m: Any, token: int) -> None:
        raise NotImplementedError


class LLGuidance(Lib):
    name, package = "llguidance", "llguidance"

    def setup(self, tok: Any, vocab: int) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch as lt

        self.ll, self.lt = llguidance, lt
        self.tokenizer = llguidance.hf.from_tokenizer(tok, n_vocab=vocab)
        self.bits = lt.allocate_token_bitmask(1, vocab)

    def compile(self, schema: dict[str, Any]) -> Any:  # the grammar is compiled when the matcher is built
        grammar = self.ll.LLMatcher.grammar_from_json_schema(json.dumps(schema),
                                                             defaults={"whitespace_flexible": False})
        m = self.ll.LLMatcher(self.tokenizer, grammar)
        if m.get_error():
            raise ValueError(m.get_error())
        return grammar

    def matcher(self, compiled: Any) -> Any:
        return self.ll.LLMatcher(self.tokenizer, compiled)

    def mask(self, m: Any) -> None:
        self.lt.fill_next_token_bitmask(m, self.bits, 0)

    def allowed(self, m: Any, token: int) -> bool:
        return _bit(self.bits[0], token)

    def advance(self, m: Any, token: int) -> None:
        if not m.consume_token(token):
            raise ValueError(m.get_error())


class XGrammar(Lib):
    name, package = "xgrammar", "xgrammar"

    def setup(self, tok: Any, vocab: int) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.bits = xgr.allocate_token_bitmask(1, vocab)

    def compile(self, schema: dict[str, Any]) -> Any:
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(",", ":"),
                                                 strict_mode=True)

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def mask(self, m: Any) -> None:
        m.fill_next_token_bitmask(self.bits)

    def allowed(self, m: Any, token: int) -> bool:
        return _bit(self.bits[0], token)

    def advance(self, m: Any, token: int) -> None:
        if not m.accept_token(token):
            raise ValueError(f"token {token} rejected")


class OutlinesCore(Lib):
    """outlines-core builds a regex from the schema and an index (DFA x vocabulary) from the regex; its
    Vocabulary.from_pretrained downloads from the Hub, so the vocabulary is built from the local tokenizer
    (byte-level BPE: each token's bytes), special tokens left out."""
    name, package = "outlines-core", "outlines_core"

    def setup(self, tok: Any, vocab: int) -> None:
        import outlines_core
        import outlines_core.kernels.torch as okt
        from outlines_core.json_schema import build_regex_from_schema
        from transformers.convert_slow_tokenizer import bytes_to_unicode

        self.oc, self.regex_of = outlines_core, build_regex_from_schema
        u2b = {u: b for b, u in bytes_to_unicode().items()}
        special = set(tok.all_special_ids)
        tokens: dict[bytes, list[int]] = {}
        for text, i in tok.get_vocab().items():
            if i not in special and i < vocab and all(c in u2b for c in text):
                tokens.setdefault(bytes(u2b[c] for c in text), []).append(i)
        self.vocabulary = outlines_core.Vocabulary(tok.eos_token_id, tokens)
        self.bits = okt.allocate_token_bitmask(vocab)

    def compile(self, schema: dict[str, Any]) -> Any:
        return self.oc.Index(self.regex_of(json.dumps(schema), whitespace_pattern=""), self.vocabulary)

    def matcher(self, compiled: Any) -> Any:
        return self.oc.Guide(compiled)

    def mask(self, m: Any) -> None:
        m.write_mask_into(self.bits.data_ptr(), self.bits.numel(), self.bits.element_size())

    def allowed(self, m: Any, token: int) -> bool:
        return _bit(self.bits[0], token)

    def advance(self, m: Any, token: int) -> None:
        m.advance(token)


class LMFormatEnforcer(Lib):
    """lm-format-enforcer works from the character level: each step it walks the tokenizer's prefix tree
    against the parser. Its transformers integration does not import under transformers 5
    (``transformers.tokenization_utils.PreTrainedTokenizerBase`` is gone), so the tokenizer data is built
    here with the core API the way that integration builds it."""
    name, package = "lm-format-enforcer", "lmformatenforcer"

    def setup(self, tok: Any, vocab: int) -> None:
        import lmformatenforcer
        from lmformatenforcer.tokenenforcer import TokenEnforcerTokenizerData

        self.lmfe = lmformatenforcer
        try:
            from lmformatenforcer.integrations.transformers import build_token_enforcer_tokenizer_data

            self.data = build_token_enforcer_tokenizer_data(tok, vocab_size=vocab)
            self.integration = "ok"
        except ImportError as e:
            self.integration = f"ImportError: {e}"
            zero = tok.encode("0", add_special_tokens=False)[-1]
            special = set(tok.all_special_ids)
            regular = []
            for i in range(vocab):
                if i in special:
                    continue
                after_0 = tok.decode([zero, i])[1:]
                regular.append((i, after_0, len(after_0) > len(tok.decode([i]))))
            self.data = TokenEnforcerTokenizerData(regular, lambda ids: tok.decode(ids).rstrip("\ufffd"),
                                                   tok.eos_token_id, False, vocab)
        self.allowed_now: Any = None

    def compile(self, schema: dict[str, Any]) -> Any:
        return self.lmfe.JsonSchemaParser(schema)

    def matcher(self, compiled: Any) -> Any:
        return {"enforcer": self.lmfe.TokenEnforcer(self.data, compiled), "ids": []}

    def mask(self, m: Any) -> None:
        self.allowed_now = m["enforcer"].get_allowed_tokens(m["ids"])

    def allowed(self, m: Any, token: int) -> bool:
        return token in set(self.allowed_now.allowed_tokens if hasattr(self.allowed_now, "allowed_tokens")
                            else self.allowed_now)

    def advance(self, m: Any, token: int) -> None:
        m["ids"].append(token)


LIBS: list[Callable[[], Lib]] = [LLGuidance, XGrammar, OutlinesCore, LMFormatEnforcer]


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def force(lib: Lib, compiled: Any, ids: list[int], eos: int) -> tuple[list[float], list[float], str | None]:
    """Push ``ids`` then EOS through a fresh matcher: (mask times, advance times, first rejection or None)."""
    m = lib.matcher(compiled)
    masks: list[float] = []
    advances: list[float] = []
    for step, token in enumerate(ids + [eos]):
        t = time.perf_counter()
        lib.mask(m)
        masks.append(time.perf_counter() - t)
        if not lib.allowed(m, token):
            return masks, advances, f"token {step} ({token}) not allowed by the mask"
        if token == eos:
            break
        t = time.perf_counter()
        lib.advance(m, token)
        advances.append(time.perf_counter() - t)
    return masks, advances, None


def bench_lib(make: Callable[[], Lib], tok: Any, vocab: int, compiles: int, runs: int) -> dict[str, Any]:
    import importlib.metadata as md

    lib = make()
    out: dict[str, Any] = {"library": lib.name}
    try:
        __import__(lib.package)
        out["version"] = md.version(lib.name)
        out["requires"] = sorted({r.split(";")[0].split(" ")[0].split("<")[0].split(">")[0].split("=")[0]
                                  .split("~")[0].split("[")[0] for r in md.requires(lib.name) or []
                                  if "extra ==" not in r})
    except Exception as e:  # absent or broken: the result says so
        return {**out, "installed": False, "error": f"{type(e).__name__}: {e}"}
    out["installed"] = True
    t = time.perf_counter()
    try:
        lib.setup(tok, vocab)
    except Exception as e:
        return {**out, "error": f"setup: {type(e).__name__}: {e}"}
    out["tokenizer_setup_s"] = time.perf_counter() - t
    if isinstance(lib, LMFormatEnforcer):
        out["transformers_integration"] = lib.integration
    out["schemas"] = {}
    for name, (schema, instance) in SCHEMAS.items():
        ids = tok.encode(json.dumps(instance, separators=(",", ":")), add_special_tokens=False)
        row: dict[str, Any] = {"json_tokens": len(ids)}
        try:
            times = []
            for _ in range(compiles):
                t = time.perf_counter()
                compiled = lib.compile(schema)
                times.append(time.perf_counter() - t)
            row["compile_s"] = statistics.median(times)
        except Exception as e:
            row.update(accepts=False, error=f"compile: {type(e).__name__}: {str(e)[:300]}")
            out["schemas"][name] = row
            continue
        masks: list[float] = []
        advances: list[float] = []
        firsts: list[float] = []
        error = None
        try:
            for _ in range(runs):
                m, a, error = force(lib, compiled, ids, tok.eos_token_id)
                firsts.append(m[0])
                masks += m
                advances += a
                if error:
                    break
        except Exception as e:
            error = f"{type(e).__name__}: {str(e)[:300]}"
        row["accepts"] = error is None
        if error:
            row["error"] = error
        if masks:
            us = [x * 1e6 for x in masks]
            row.update(mask_us_mean=statistics.fmean(us), mask_us_p50=_pct(us, 0.5), mask_us_p99=_pct(us, 0.99),
                       mask_samples=len(us), first_mask_us_mean=statistics.fmean(firsts) * 1e6)
        if advances:
            row["advance_us_mean"] = statistics.fmean(x * 1e6 for x in advances)
        if masks and advances:
            row["per_token_us"] = row["mask_us_mean"] + row["advance_us_mean"]
        out["schemas"][name] = row
        print(f"{lib.name:20s} {name:12s} " + json.dumps({k: (round(v, 4) if isinstance(v, float) else v)
                                                          for k, v in row.items()}), flush=True)
    return out


def decode_step_ms(path: str, steps: int = 24) -> float:
    """For scale: the median time of one cached single-token decode step of the model itself (fp32)."""
    import torch
    from transformers import AutoModelForCausalLM

    from kvboost_core.model.driver import output_cache

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    times = []
    with torch.inference_mode():
        out = model(input_ids=torch.arange(1, 65)[None], use_cache=True)
        cache = output_cache(out)
        for i in range(steps):
            t = time.perf_counter()
            out = model(input_ids=torch.tensor([[100 + i]]), cache=cache, use_cache=True)
            cache = output_cache(out)
            times.append(time.perf_counter() - t)
    return statistics.median(times[4:]) * 1e3


def plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    libs = [r for r in results if r.get("schemas")]
    names = list(SCHEMAS)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / max(1, len(libs))
    for k, r in enumerate(libs):
        xs = [i + k * width for i in range(len(names))]
        p50 = [r["schemas"].get(n, {}).get("mask_us_p50", 0) for n in names]
        p99 = [r["schemas"].get(n, {}).get("mask_us_p99", 0) for n in names]
        ax1.bar(xs, p99, width, alpha=0.35, color=f"C{k}")
        ax1.bar(xs, p50, width, label=r["library"], color=f"C{k}")
        total = [r["schemas"].get(n, {}).get("per_token_us") for n in names]
        ax1.scatter([x for x, t in zip(xs, total) if t], [t for t in total if t], marker="D", s=18, color="k",
                    label="mean mask + advance" if k == 0 else None, zorder=3)
        ax2.bar(xs, [r["schemas"].get(n, {}).get("compile_s", 0) * 1e3 for n in names], width,
                label=r["library"], color=f"C{k}")
    for ax, title in ((ax1, "next-token mask, us (solid p50, light p99; black: mean mask + advance)"), (ax2, "schema compile, ms")):
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(names))], names)
        ax.set_yscale("log")
        ax.set_title(title)
        ax.legend(fontsize=8)
    fig.suptitle("Grammar libraries on the SmolLM2-135M tokenizer (vocab 49152), 1 thread")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct", help="zoo name or path of the tokenizer")
    ap.add_argument("--compiles", type=int, default=3, help="compiles per schema (the median is reported)")
    ap.add_argument("--runs", type=int, default=20, help="forced passes per schema, fresh matcher each")
    ap.add_argument("--libs", default=",".join(m.name for m in (L() for L in LIBS)),
                    help="comma-separated subset of the libraries")
    ap.add_argument("--no-decode-step", action="store_true",
                    help="skip timing the model's own decode step (the scale the mask cost is compared with)")
    ap.add_argument("--json", type=Path, default=REPO / "benchmarks/results/grammar.json")
    ap.add_argument("--png", type=Path, default=REPO / "benchmarks/results/grammar.png")
    args = ap.parse_args(argv)
    if args.compiles < 1 or args.runs < 1:
        ap.error("--compiles and --runs must be >= 1")
    from transformers import AutoTokenizer

    from kvboost_core import zoo

    path = zoo.resolve(args.model) if zoo.is_zoo_name(args.model) else args.model
    tok = AutoTokenizer.from_pretrained(path)
    vocab = len(tok)
    wanted = set(args.libs.split(","))
    results = [bench_lib(L, tok, vocab, args.compiles, args.runs) for L in LIBS if L().name in wanted]
    import torch

    step_ms = None if args.no_decode_step or not Path(path, "config.json").exists() else decode_step_ms(path)
    report = {"decode_step_ms": step_ms, "command": "OMP_NUM_THREADS=1 python benchmarks/bench_grammar.py " + " ".join(argv or sys.argv[1:]),
              "tokenizer": args.model, "vocab": vocab, "torch": torch.__version__, "python": platform.python_version(),
              "cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
              "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "compiles": args.compiles, "runs": args.runs,
              "schemas": {n: s for n, (s, _) in SCHEMAS.items()}, "results": results}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1) + "\n")
    plot(results, args.png)
    print(f"wrote {args.json} and {args.png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
