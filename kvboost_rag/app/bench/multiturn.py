"""Multi-turn RAG chat benchmark: TTFT per turn for HF full prefill, exact prefix reuse alone, and kvboost.

Each conversation (tune split only; eval is held out) opens with retrieved documents and a question; later turns
ask follow-ups about the same documents, some turns retrieve new ones, and every answer in the history is the
model's own (plain HF's greedy answer, so all three methods see the same prompt at every turn). Per turn:

- ``hf``: ``model(ids, logits_to_keep=1)`` from scratch, then greedy decoding (the reference answer);
- ``apc``: exact prefix reuse as vLLM's automatic prefix caching does it: the longest identical token prefix of
  any earlier sequence (prompt and generated tokens) is served from HF's own cache, the rest is prefilled
  (at token granularity: an upper bound of vLLM's 16-token blocks). Its copy of the cache is off the clock;
- ``kvboost``: ``KVBoostRAG.generate`` at the engine's defaults (the model's shipped settings), its store
  filled only by warming the corpus and by earlier turns.

Reported per turn: TTFT and prompt-token hit rate of each, kvboost's exact and approximate shares, and whether
kvboost's answer equals HF's (required on every turn whose reuse was exact only). Speedups
print as full / reuse.

Run ``python benchmarks/bench_multiturn.py --json benchmarks/results/multiturn.json --plot ...png``.
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvboost_rag.app.bench.flops import speedup
from kvboost_rag.app.bench.prefix import longest_prefix
from kvboost_rag.app.bench.turn_plot import finish_turn_figure
from kvboost_rag.app.rag_corpus import questions_by_doc

DEFAULT_MODEL = "smollm2-135m-instruct"

RETRIEVE_TURNS = (1, 4, 7)  # turns that retrieve new documents; the others follow up on what is in the history


# kvboost variants: EngineConfig overrides on top of the model's shipped settings
VARIANTS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "backfill": {"backfill": True},  # exact history (kvboost_core.serving.backfill)
    "block+backfill": {"backfill": True, "block_adapter": "shipped"},  # documents at repair="none"
}


@dataclass(slots=True)
class Reuse:
    """One kvboost variant on one turn."""

    ttft_s: float
    hit: float  # share of the prompt reused (exact + approximate), not recomputed
    exact: float
    approx: float
    exact_only: bool  # no approximate token was reused: the answer must equal HF's
    same_answer: bool  # the greedy answer text == HF's
    backfill_s: float  # the exact-history job after the answer, between turns (off the TTFT clock)


@dataclass(slots=True)
class Turn:
    conversation: int
    turn: int
    retrieved: bool
    prompt_tokens: int
    hf_ttft_s: float
    apc_ttft_s: float
    apc_hit: float  # share of the prompt served from an earlier sequence's exact prefix
    apc_top1: bool  # APC's first token == HF's
    kvboost: dict[str, Reuse]


def plan_conversation(corpus: Any, k: int, turns: int, seed: int) -> list[tuple[list[Any], Any]]:
    """Per turn: (documents retrieved at this turn, possibly none; the question). Retrieval turns take ``k``
    documents not shown before, the question's gold document among them; follow-ups ask about a document
    already in the conversation."""
    rng = random.Random(seed)
    by_doc = questions_by_doc(corpus)
    shown: list[Any] = []
    asked: set[str] = set()
    plan = []
    for t in range(1, turns + 1):
        if t in RETRIEVE_TURNS or not shown:
            fresh = [d for d in corpus.documents if d not in shown and by_doc.get(d.id)]
            gold = rng.choice(fresh)
            rest = [d for d in corpus.documents if d not in shown and d is not gold]
            docs = [gold, *rng.sample(rest, min(k - 1, len(rest)))]
            rng.shuffle(docs)
            shown += docs
            q = rng.choice([q for q in by_doc[gold.id] if q.id not in asked] or by_doc[gold.id])
            plan.append((docs, q))
        else:
            pool = [q for d in shown for q in by_doc.get(d.id, []) if q.id not in asked]
            q = rng.choice(pool or [q for d in shown for q in by_doc.get(d.id, [])])
            plan.append(([], q))
        asked.add(plan[-1][1].id)
    return plan


def user_turn(docs: list[str], question: str) -> str:
    if not docs:
        return f"Question: {question}"
    return "Documents:\n\n" + "\n\n".join(docs) + f"\n\nQuestion: {question}"


class PrefixReuse:
    """Exact prefix reuse alone (vLLM APC): HF caches of earlier full sequences, longest common prefix wins."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.entries: list[tuple[list[int], Any]] = []

    def hit(self, ids: list[int]) -> tuple[int, Any]:
        best_n, best = longest_prefix(self.entries, ids)
        return min(best_n, len(ids) - 1), best  # the last prompt token is always computed

    def first_token(self, ids: list[int]) -> tuple[float, int, int]:
        """(TTFT, tokens reused, first token)."""
        import torch

        n, best = self.hit(ids)
        cache = None
        if best is not None and n > 0:
            cache = copy.deepcopy(best)  # vLLM shares blocks without a copy: keep it off the clock
            cache.crop(n - cache.get_seq_length())
        with torch.inference_mode():
            t0 = time.perf_counter()
            out = self.model(input_ids=torch.tensor([ids[n:]], device=self.model.device), cache=cache,
                             use_cache=True, logits_to_keep=1)
            tok = int(out.logits[0, -1].argmax())
            return time.perf_counter() - t0, n, tok

    def add(self, seq: list[int], cache: Any) -> None:
        self.entries.append((seq, cache))


def _hf_answer(model: Any, tokenizer: Any, ids: list[int], max_new: int, eos: set[int]) -> tuple[Any, Any]:
    """HF's greedy reference, and its cache over the prompt and every generated token but the last."""
    import torch

    from kvboost_core.model.driver import output_cache
    from kvboost_rag.app.bench.rag import hf_greedy

    ref = hf_greedy(model, tokenizer, ids, max_new, eos)
    seq = list(ids) + ref.tokens[:-1]
    with torch.inference_mode():
        cache = output_cache(model(input_ids=torch.tensor([seq], device=model.device), use_cache=True,
                                   logits_to_keep=1))  # off the clock: APC's stored blocks
    return ref, (seq, cache)


def _kvboost_turn(rag: Any, prompt: str, special: bool, ids: list[int], ref: Any, max_new: int) -> Reuse:
    res = rag.generate(prompt, max_new_tokens=max_new, add_special_tokens=special)
    if res.prompt_token_ids != ids:
        raise RuntimeError("prompt drift: kvboost tokenized the prompt differently from HF")
    t0 = time.perf_counter()
    if not rag.engine.wait_backfill(timeout=3600):
        raise RuntimeError("the backfill job did not finish within an hour")
    backfill_s = time.perf_counter() - t0 if rag.engine.config.backfill else 0.0
    st, n = res.stats, len(ids)
    approx = st["reused_approx"] + st.get("reused_repaired", 0) + st.get("reused_block", 0)
    return Reuse(st["ttft_s"], (st["reused_exact"] + approx) / n, st["reused_exact"] / n, approx / n, approx == 0,
                 res.text.strip() == ref.text.strip(), backfill_s)


def run(rags: dict[str, Any], conversations: int, turns: int, k: int, max_new_tokens: int, seed: int = 0,
        log: Any = print, partial: Any = None) -> dict[str, Any]:
    """The benchmark over ``rags`` (variant name -> KVBoostRAG; the first one's model is the HF reference);
    ``partial(result)``, when given, is called after every turn with the result so far."""
    from kvboost_rag.app import rag_corpus as rc
    from kvboost_rag.app.bench.rag import SYSTEM

    corpus = rc.load_corpus("tune")  # tuning split only
    warm_s = {}
    for name, rag in rags.items():
        t0 = time.perf_counter()
        rag.warm_documents([rc.doc_text(d) for d in corpus.documents], progress=False)
        warm_s[name] = time.perf_counter() - t0
    first = next(iter(rags.values()))
    model, tok = first.engine.model, first.engine.tokenizer
    eos = set(first.engine.eos_token_ids)
    rows: list[Turn] = []
    for c in range(conversations):
        apc = PrefixReuse(model)
        messages: list[dict[str, str]] = [{"role": "system", "content": SYSTEM}]
        for t, (docs, q) in enumerate(plan_conversation(corpus, k, turns, seed + c), start=1):
            messages.append({"role": "user", "content": user_turn([rc.doc_text(d) for d in docs], q.question)})
            prompt = first.chat_prompt(messages)
            special = first.chat_add_special_tokens(prompt)
            ids = first.encode(prompt, special)
            apc_s, apc_n, apc_tok = apc.first_token(ids)
            ref, entry = _hf_answer(model, tok, ids, max_new_tokens, eos)
            kv = {name: _kvboost_turn(rag, prompt, special, ids, ref, max_new_tokens) for name, rag in rags.items()}
            apc.add(*entry)
            n = len(ids)
            rows.append(Turn(c, t, bool(docs), n, ref.ttft_s, apc_s, apc_n / n, apc_tok == ref.tokens[0], kv))
            if log:
                log(f"conv {c + 1} turn {t:>2} {n:>5} tok  hf {ref.ttft_s:6.2f}s  apc {apc_s:6.2f}s "
                    f"(hit {apc_n / n:4.0%})" + "".join(
                        f"  {name} {r.ttft_s:6.2f}s (hit {r.hit:4.0%}, exact {r.exact:4.0%}, "
                        f"{'same' if r.same_answer else 'DIFF'})" for name, r in kv.items()))
            messages.append({"role": "assistant", "content": ref.text})
            if partial is not None:
                partial(_result(rags, conversations, turns, k, max_new_tokens, warm_s, rows))
    return _result(rags, conversations, turns, k, max_new_tokens, warm_s, rows)


def _result(rags: dict[str, Any], conversations: int, turns: int, k: int, max_new_tokens: int,
            warm_s: dict[str, float], rows: list[Turn]) -> dict[str, Any]:
    engines = {name: {"repair": r.engine.config.repair, "recompute_ratio": r.engine.config.recompute_ratio,
                      "check_layer": r.engine.config.check_layer, "store_prefix": r.engine.config.store_prefix,
                      "backfill": r.engine.config.backfill, "block_adapter": r.engine.config.block_adapter}
               for name, r in rags.items()}
    return {"split": "tune", "conversations": conversations, "turns": turns, "k": k,
            "max_new_tokens": max_new_tokens, "retrieve_turns": list(RETRIEVE_TURNS), "warm_s": warm_s,
            "variants": engines, "per_turn": summarize(rows), "rows": [asdict(r) for r in rows]}


def summarize(rows: list[Turn]) -> list[dict[str, Any]]:
    """Per turn number, medians over conversations; speedups are full / reuse of those medians."""
    out = []
    for t in sorted({r.turn for r in rows}):
        rs = [r for r in rows if r.turn == t]
        hf = statistics.median(r.hf_ttft_s for r in rs)
        apc = statistics.median(r.apc_ttft_s for r in rs)
        variants = {}
        for name in rs[0].kvboost:
            vs = [(r, r.kvboost[name]) for r in rs]
            kv = statistics.median(v.ttft_s for _, v in vs)
            exact_rows = [v for _, v in vs if v.exact_only]
            variants[name] = {
                "ttft_s": kv, "speedup": hf / kv, "hit": statistics.median(v.hit for _, v in vs),
                "exact": statistics.median(v.exact for _, v in vs),
                "hit_at_least_apc": all(v.hit >= r.apc_hit for r, v in vs),
                "exact_only_turns": len(exact_rows),
                "exact_only_same_answer": sum(v.same_answer for v in exact_rows),
                "same_answer": sum(v.same_answer for _, v in vs),
                "backfill_s": statistics.median(v.backfill_s for _, v in vs)}
        out.append({"turn": t, "prompt_tokens": statistics.median(r.prompt_tokens for r in rs), "hf_ttft_s": hf,
                    "apc_ttft_s": apc, "apc_speedup": hf / apc, "apc_hit": statistics.median(r.apc_hit for r in rs),
                    "conversations": len(rs), "kvboost": variants})
    return out


def plot(result: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pt = result["per_turn"]
    turns = [p["turn"] for p in pt]
    names = list(pt[0]["kvboost"]) if pt else []
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4.2))
    colors = iter(plt.rcParams["axes.prop_cycle"].by_key()["color"])
    c = next(colors)
    ax.plot(turns, [p["hf_ttft_s"] for p in pt], marker="o", color=c, label="HF full prefill")
    c = next(colors)  # one colour per method on both panels
    ax.plot(turns, [p["apc_ttft_s"] for p in pt], marker="o", color=c, label="exact prefix reuse (APC)")
    bx.plot(turns, [p["apc_hit"] for p in pt], marker="o", color=c, label="APC")
    for name in names:
        c = next(colors)
        ax.plot(turns, [p["kvboost"][name]["ttft_s"] for p in pt], marker="o", color=c, label=f"kvboost {name}")
        bx.plot(turns, [p["kvboost"][name]["hit"] for p in pt], marker="o", color=c, label=f"kvboost {name}")
        bx.plot(turns, [p["kvboost"][name]["exact"] for p in pt], marker=".", linestyle=":", color=c,
                label=f"kvboost {name}, exact")
    finish_turn_figure(fig, ax, bx,
                       xlabel="turn (new documents on turns " + ", ".join(map(str, result["retrieve_turns"])) + ")",
                       share_label="prompt tokens reused, not recomputed",
                       title=f"Multi-turn RAG chat — {result['model']}, {result['threads']} thread(s)", path=path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvboost-rag bench multiturn", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL, help="a short name, a local HF folder or a hub id")
    ap.add_argument("--conversations", type=int, default=2)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--k", type=int, default=10, help=f"documents per retrieval (turns {RETRIEVE_TURNS})")
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--variants", default="defaults,backfill",
                    help=f"kvboost engines to run, comma-separated, from {', '.join(VARIANTS)}")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", dest="json_path")
    ap.add_argument("--plot", dest="plot_path")
    args = ap.parse_args(argv)
    if args.turns < 1 or args.conversations < 1 or args.k < 1:
        ap.error("--turns, --conversations and --k must be >= 1")
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown or not names:
        ap.error(f"--variants: unknown {unknown}; choose from {', '.join(VARIANTS)}")
    from kvboost_rag.app.loading import check_model_arg, load_rag

    check_model_arg(args.model)  # one line at once, before torch loads
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    rags = {name: load_rag(args.model, **VARIANTS[name]) for name in names}
    if VARIANTS[names[0]].get("block_adapter"):
        ap.error("--variants: the first variant's model is HF's reference; put a base-model variant first")

    def save(result: dict[str, Any]) -> None:
        result.update(model=args.model, threads=torch.get_num_threads())
        if args.json_path:
            Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json_path).write_text(json.dumps(result, indent=1))

    result = run(rags, args.conversations, args.turns, args.k, args.max_new_tokens, args.seed, partial=save)
    save(result)
    print("\nturn  tokens   HF s  APC s (hit)        " + "".join(f"{n:>28}" for n in names) + "   backfill s")
    for p in result["per_turn"]:
        cells = "".join(f"{v['ttft_s']:7.2f}s {speedup(v['speedup']):>13} {v['hit']:5.0%}"
                        for v in p["kvboost"].values())
        print(f"{p['turn']:>4} {p['prompt_tokens']:>7.0f} {p['hf_ttft_s']:6.2f} {p['apc_ttft_s']:6.2f} "
              f"({p['apc_hit']:4.0%}) {speedup(p['apc_speedup']):>13}  {cells}   "
              + " ".join(f"{v['backfill_s']:.2f}" for v in p["kvboost"].values()))
    if args.plot_path:
        plot(result, args.plot_path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
