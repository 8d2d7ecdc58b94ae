"""Side-by-side TTFT benchmark: full prefill, exact-prefix caching and kvboost's reuse paths in one process.

Workload A (RAG): a warmed corpus; each query takes ``n`` documents in a new order after a fixed system prompt,
plus a fresh question. Methods run alternately on the same prompts, so drift on a shared machine hits all of
them alike; medians and ratios against full prefill are reported. TTFT counts from the call's start and
includes lookup, re-rotation, dequantization and repair. With the ``bench`` extra installed, the PyPI package
``kvboost`` 0.9.0 (an unrelated project) runs beside them on the same model and prompts: see :mod:`.peer`.

Workload B (chat): an 8-turn conversation; per turn, TTFT of ours against full prefill and exact-prefix caching.

The models are :mod:`.models`' (named random-weight shapes, or a local model); the baselines :mod:`.baselines`'.

Run ``kvboost-rag bench --shape qwen2.5-0.5b --json out.json --plot out.png`` (``--layers`` cuts the depth for a
quick look).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import random
import re
import statistics
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvboost_rag.app.bench.baselines import ExactPrefixCache, full_prefill, timed
from kvboost_rag.app.bench.flops import Shape, flop_summary, plot_flops, print_flops, speedup, trace_flops
from kvboost_rag.app.bench.models import DTYPES, SHAPES, build_model, load_model, model_path
from kvboost_rag.app.bench.quality import STORIES_DEFAULT, demo_accuracy, stories_fidelity

if TYPE_CHECKING:
    import torch

REUSE_METHODS = ("none", "selective", "cacheblend")


def _reuse_kwargs(method: str) -> dict[str, Any]:
    """``cacheblend-0.3`` -> CacheBlend at ratio 0.3; other names are a repair at the engine's settings."""
    if method.startswith("cacheblend-"):
        return {"repair": "cacheblend", "recompute_ratio": float(method.removeprefix("cacheblend-"))}
    return {"repair": method}


def _block_rows() -> int:
    from kvboost_core.model import attention

    return attention.BLOCK_ROWS


def _kl(ref: torch.Tensor, got: torch.Tensor) -> float:
    import torch

    lp, lq = torch.log_softmax(ref, -1), torch.log_softmax(got.float(), -1)
    return float((lp.exp() * (lp - lq)).sum())


def word_vocab(tok: Any, limit: int = 4096) -> list[int]:
    """Token ids that decode to one space-led word and re-encode to themselves. A byte-level BPE splits before
    each space, so any sequence of them decodes to text that re-tokenizes to the same ids."""
    texts = tok.batch_decode([[i] for i in range(len(tok))])
    cand = [(i, t) for i, t in enumerate(texts) if re.fullmatch(r" [A-Za-z]{1,16}", t)]
    enc = tok([t for _, t in cand], add_special_tokens=False)["input_ids"] if cand else []
    return [i for (i, _), e in zip(cand, enc) if list(e) == [i]][:limit]


def workload_a(engine: Any, sizes: list[int], rounds: int, doc_tokens: int, question_tokens: int,
               seed: int = 0, system_tokens: int = 32, ratios: tuple[float, ...] = (),
               only: tuple[str, ...] = ()) -> dict[str, Any]:
    import torch

    from kvboost_core import Segment
    from kvboost_core.model.forward import record_traces
    from kvboost_rag.app.bench.peer import load_peer, peer_chunk_size, summarize

    rng = random.Random(seed)
    # Documents, system prompt and questions are random words of the tokenizer's vocabulary (word_vocab), so
    # the text-only peer gets a prompt that tokenizes to exactly the ids our engine sees. A tokenizer with too
    # few such words (SentencePiece: a lone token decodes without its space) falls back to raw random ids.
    vocab = word_vocab(engine.tokenizer)
    text_ok = len(vocab) >= 16
    if not text_ok:
        vocab = list(range(10, len(engine.tokenizer) - 1))
    n_corpus = max(sizes) + 4
    corpus = [[rng.choice(vocab) for _ in range(doc_tokens)] for _ in range(n_corpus)]
    lead = engine.tokenize_ids([Segment(token_ids=[vocab[0]])])[:-1]  # BOS, when the tokenizer adds one
    if system_tokens <= len(lead):
        raise ValueError(f"system_tokens must exceed the {len(lead)} lead token(s), got {system_tokens}")
    system = [rng.choice(vocab) for _ in range(system_tokens - len(lead))]  # lead + system: system_tokens
    warm_s, _ = timed(lambda: engine.warm([Segment(token_ids=d) for d in corpus]))
    apc = ExactPrefixCache(engine.model)
    # the cold path: our engine with an empty store that is never written (no hit of any kind)
    cold_engine = type(engine)(engine.model, engine.tokenizer, engine.config.with_(store="memory",
                                                                                   store_prefix=False))
    # exact_repeat measures the opt-in store_repaired=True (a repeat served the first call's repaired KV); the
    # default engine never serves repaired KV, so a repeat costs what the first call cost. Same store: no re-warm.
    repeat_engine = type(engine)(engine.model, engine.tokenizer, engine.config.with_(store=engine.store,
                                                                                     store_repaired=True))
    cfg = engine.config
    chunk = peer_chunk_size(system_tokens, doc_tokens)
    peer, peer_info = (load_peer(engine.model, engine.tokenizer, lead, chunk, cfg.recompute_ratio,
                                 cfg.max_cache_bytes) if text_ok and (not only or "peer" in only)
                       else (None, "not selected (--methods)" if text_ok
                             else "the tokenizer has no text-stable word vocabulary for the peer"))
    peer_name = peer.name if peer is not None else ""  # kept after a failure: its rounds are then skipped

    def peer_failed(exc: Exception, where: str) -> None:  # its errors are recorded, never fatal to ours
        nonlocal peer, peer_info
        assert peer is not None
        peer_info = {**peer.finish(), "error": f"{where}: {type(exc).__name__}: {exc}"}
        peer = None

    if peer is not None:
        try:
            peer.warm(system, corpus)
        except Exception as exc:
            peer_failed(exc, "warm")
    rows: dict[int, dict[str, list[dict[str, Any]]]] = {n: defaultdict(list) for n in sizes}
    reuse = [*REUSE_METHODS, *(f"cacheblend-{r:g}" for r in ratios)]
    methods = ["full", "prefix_cache", "cold", *reuse, *([peer_name] if peer else []), "exact_repeat"]
    if only:  # a subset (long contexts on a slow machine); full prefill is always the reference ("peer": the peer)
        methods = ["full", *(m for m in methods if (m in only or (m == peer_name and "peer" in only)) and m != "full")]
    shape = Shape.of(engine.model.config)
    for r in range(rounds):
        for n in sizes:
            docs = rng.sample(corpus, n)
            question = [rng.choice(vocab) for _ in range(question_tokens)]
            segs = ([Segment(token_ids=system)] + [Segment(token_ids=d, cacheable=True) for d in docs]
                    + [Segment(token_ids=question)])
            ids = engine.tokenize_ids(segs)
            order = methods[r % len(methods):] + methods[: r % len(methods)]  # alternate who goes first
            ref = None
            for m in order:
                if m == "full":
                    dt, ref_m = full_prefill(engine.model, ids)
                    rows[n][m].append({"ttft_s": dt, "reuse": 0.0})
                    ref = ref_m
                elif m == "prefix_cache":
                    dt, _ = apc.first_token(ids)
                    rows[n][m].append({"ttft_s": dt, "reuse": 0.0})
                elif m == "cold":
                    res = cold_engine.generate(segs, max_new_tokens=1, repair="none")
                    rows[n][m].append({"ttft_s": res.ttft_s, "reuse": res.reuse_ratio})
                elif m == "exact_repeat":
                    repeat_engine.generate(segs, max_new_tokens=1, repair="cacheblend")  # stores it repaired
                    res = repeat_engine.generate(segs, max_new_tokens=1, repair="cacheblend", store_prefix=False)
                    rows[n][m].append({"ttft_s": res.ttft_s, "reuse": res.reuse_ratio})
                elif m == peer_name:
                    if peer is not None:
                        try:
                            rows[n][m].append(peer.first_token(peer.text([system, *docs, question]), ids))
                        except Exception as exc:
                            peer_failed(exc, f"generate ({n} documents, round {r + 1})")
                else:
                    kw = _reuse_kwargs(m)
                    res = engine.generate(segs, max_new_tokens=1, store_prefix=False, **kw)
                    with record_traces() as traces:  # the same schedule again, off the clock: its FLOPs
                        pre = engine.prefill(segs, store_prefix=False, **kw)
                    fl = trace_flops(shape, traces)
                    rows[n][m].append({"ttft_s": res.ttft_s, "reuse": res.reuse_ratio,
                                       "logits": pre.last_logits, "flops_ideal": fl.ideal,
                                       "flops_implemented": fl.implemented})
            assert ref is not None
            for m in (*reuse, *([peer_name] if peer_name else [])):
                last = rows[n][m][-1] if rows[n][m] else {}
                if "logits" in last:
                    got = last.pop("logits")
                    last["kl"] = _kl(ref, got)
                    last["top1"] = float(int(torch.argmax(ref)) == int(torch.argmax(got)))
        print(f"  round {r + 1}/{rounds} done", flush=True)
    out: dict[str, Any] = {"warm_s": warm_s, "corpus_tokens": n_corpus * doc_tokens, "sizes": {},
                           "peer": peer.finish() if peer is not None else peer_info}
    for n in sizes:
        ctx = len(lead) + len(system) + n * doc_tokens + question_tokens
        full_med = statistics.median(x["ttft_s"] for x in rows[n]["full"])
        summary = {}
        for m in methods:
            xs = rows[n][m]
            if not xs:  # the peer, after it failed
                continue
            med = statistics.median(x["ttft_s"] for x in xs)
            summary[m] = {"ttft_median_s": med, "speedup_vs_full": full_med / med,
                          "reuse_ratio": statistics.fmean(x["reuse"] for x in xs),
                          "ttft_all_s": [x["ttft_s"] for x in xs]}
            if "kl" in xs[0]:
                summary[m]["mean_kl"] = statistics.fmean(x["kl"] for x in xs)
                summary[m]["top1_agree"] = statistics.fmean(x["top1"] for x in xs)
            if m == peer_name:
                summary[m].update(summarize(xs))
            if "flops_ideal" in xs[0] or m == "full":
                summary[m].update(flop_summary(shape, ctx, xs, med / full_med))
        entry: dict[str, Any] = {"documents": n, "context_tokens": ctx, "methods": summary}
        if peer_name in summary:
            ratio = summary[peer_name]["ttft_median_s"] / summary["cacheblend"]["ttft_median_s"]
            entry["ours_cacheblend_vs_peer_cacheblend"] = ratio
            out.setdefault("ours_cacheblend_vs_peer_cacheblend", {})[str(n)] = ratio
        out["sizes"][str(n)] = entry
    return out


def workload_b(engine: Any, turns: int = 8, reply_tokens: int = 16, seed: int = 1) -> dict[str, Any]:
    """Multi-turn chat through ChatKVBoost; per turn TTFT against full prefill and exact-prefix caching."""
    from langchain_core.messages import AIMessage, HumanMessage
    from langchain_kvboost import ChatKVBoost

    rng = random.Random(seed)
    words = ["river", "castle", "engine", "garden", "planet", "market", "violin", "harbour", "lantern", "meadow"]
    chat = ChatKVBoost(engine=engine, max_new_tokens=reply_tokens)
    apc = ExactPrefixCache(engine.model)
    history: list[Any] = []
    per_turn = []
    for t in range(turns):
        history.append(HumanMessage(" ".join(rng.choice(words) for _ in range(60))))
        reply = chat.invoke(history)
        stats = dict(chat.last_stats)
        prompt = chat.rag.chat_prompt([{"role": "user" if isinstance(m, HumanMessage) else "assistant",
                                         "content": m.content} for m in history])
        ids = chat.rag.token_ids(prompt)
        full_s, _ = full_prefill(engine.model, ids)
        apc_s, _ = apc.first_token(ids)
        per_turn.append({"turn": t + 1, "prompt_tokens": stats["prompt_tokens"], "ours_ttft_s": stats["ttft_s"],
                         "full_ttft_s": full_s, "prefix_cache_ttft_s": apc_s,
                         "reused_exact": stats["reused_exact"]})
        history.append(AIMessage(reply.content))
    return {"turns": per_turn}


def plot(result: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = result["workload_a"]["sizes"]
    ctx = [v["context_tokens"] for v in sizes.values()]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for m in dict.fromkeys(m for v in sizes.values() for m in v["methods"]):  # the peer may miss a size
        pts = [(c, v["methods"][m]["ttft_median_s"]) for c, v in zip(ctx, sizes.values())
               if m in v["methods"]]
        ax.plot(*zip(*pts), marker="o", label=m)
    ax.set_xlabel("context tokens")
    ax.set_ylabel("TTFT, median (s)")
    ax.set_yscale("log")
    ax.set_title(f"TTFT vs context — {result['model']}, {result['machine']['cpu_threads']} threads")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def _print_quality(q: dict[str, Any]) -> None:
    acc = q["demo_accuracy"]
    if "skipped" in acc:
        print(f"\ndemo-model accuracy: skipped ({acc['skipped']})")
    else:
        print(f"\ndemo-model accuracy, {acc['questions']} held-out questions "
              f"(closed book {acc['closed_book_accuracy']:.0%}):")
        for m, s in acc["methods"].items():
            print(f"  {m:<11} {s['accuracy']:6.1%}  same answer as full {s['agreement_with_full']:6.1%}"
                  f"  reuse {s['reuse_ratio']:.0%}")
    fid = q["stories_fidelity"]
    if "skipped" in fid:
        print(f"stories260K fidelity: skipped ({fid['skipped']})")
    else:
        print(f"stories260K fidelity, {fid['prompts']} prompts of reordered warmed documents vs full prefill:")
        for m, s in fid["summary"].items():
            print(f"  {m:<11} mean KL {s['mean_kl']:.4f}  top-1 {s['top1_agree']:.0%}  "
                  f"greedy match {s['greedy_match']:.0%}")


def main(argv: list[str] | None = None) -> int:
    if argv and argv[0] == "rag":  # the real-model RAG answers benchmark has its own options
        from kvboost_rag.app.bench import rag as bench_rag

        return bench_rag.main(argv[1:])
    if argv and argv[0] == "multiturn":  # the multi-turn RAG chat benchmark
        from kvboost_rag.app.bench import multiturn

        return multiturn.main(argv[1:])
    ap = argparse.ArgumentParser(prog="kvboost-rag bench", description=__doc__.split("\n\n")[0],
                                 epilog="kvboost-rag bench rag --help: the real-model RAG answers benchmark; "
                                        "kvboost-rag bench multiturn --help: the multi-turn chat benchmark")
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--model", help="a local HF model directory or a short name (smollm2-135m-instruct)")
    src.add_argument("--shape", default="qwen2.5-0.5b", help=f"random-weight shape: {', '.join(SHAPES)}")
    ap.add_argument("--layers", type=int, help="override the number of layers (quick runs)")
    ap.add_argument("--sizes", default="2,4,8", help="documents per query, comma-separated")
    ap.add_argument("--doc-tokens", type=int, default=512)
    ap.add_argument("--question-tokens", type=int, default=64)
    ap.add_argument("--system-tokens", type=int, default=32, help="system prompt, lead (BOS) included")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--chat-turns", type=int, default=8, help="0 skips workload B")
    ap.add_argument("--demo-questions", type=int, default=60,
                    help="held-out questions the demo model answers per method (0 skips)")
    ap.add_argument("--stories", default=str(STORIES_DEFAULT),
                    help="a trained model for the KL/top-1 report (default ../shared/models/stories260K; "
                         "'none' skips)")
    ap.add_argument("--stories-prompts", type=int, default=20)
    ap.add_argument("--device", default="cpu", help="cpu or cuda (the model, the engine and every baseline)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: fp32 on cpu, bf16 on cuda")
    ap.add_argument("--ratios", default="", help="extra CacheBlend recompute ratios, e.g. 0.15,0.3,0.5,0.7")
    ap.add_argument("--methods", default="", help="run only these methods (comma-separated; full always runs)")
    ap.add_argument("--threads", type=int, help="torch CPU threads")
    ap.add_argument("--block-rows", type=int, default=None,
                    help="query rows per attention block (0: the former dense mask, for comparison)")
    ap.add_argument("--json", dest="json_path")
    ap.add_argument("--plot", dest="plot_path")
    args = ap.parse_args(argv)
    if args.model:
        from kvboost_rag.app.loading import check_model_arg

        check_model_arg(args.model)  # one line at once, before torch loads
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.block_rows is not None:
        from kvboost_core.model import attention

        attention.BLOCK_ROWS = args.block_rows
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("--device cuda needs a CUDA build of torch and a visible GPU; use --device cpu")

    from kvboost_core import KVEngine

    dtype = getattr(torch, DTYPES[args.dtype or ("bf16" if args.device.startswith("cuda") else "fp32")])
    model, tok = (load_model(model_path(args.model), args.device, dtype) if args.model
                  else build_model(args.shape, args.layers, device=args.device, dtype=dtype))
    engine = KVEngine(model, tok, max_cache_bytes="16GiB")
    sizes = [int(s) for s in args.sizes.split(",") if s]
    name = args.model or f"{args.shape} (random weights{'' if args.layers is None else f', {args.layers} layers'})"
    print(f"bench: {name}, sizes {sizes}, {args.rounds} rounds, {model.device} {dtype}, "
          f"torch threads {torch.get_num_threads()}")
    result: dict[str, Any] = {
        "model": name, "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "processor": platform.processor(),
                    "cpu_count": os.cpu_count(), "cpu_threads": torch.get_num_threads(),
                    "torch": torch.__version__, "device": str(model.device), "dtype": str(dtype).removeprefix("torch."),
                    "gpu": torch.cuda.get_device_name() if model.device.type == "cuda" else None},
        "attention_block_rows": _block_rows(),
        "engine": {"chunk_size": engine.config.chunk_size, "recompute_ratio": engine.config.recompute_ratio,
                   "select": engine.config.select, "overlap_k": engine.config.overlap_k,
                   "sink_tokens": engine.config.sink_tokens},
        "workload_a": workload_a(engine, sizes, args.rounds, args.doc_tokens, args.question_tokens,
                                 system_tokens=args.system_tokens,
                                 ratios=tuple(float(r) for r in args.ratios.split(",") if r),
                                 only=tuple(m for m in args.methods.split(",") if m)),
    }
    if args.chat_turns:
        result["workload_b"] = workload_b(engine, args.chat_turns)
    result["quality"] = {
        "demo_accuracy": (demo_accuracy(args.demo_questions) if args.demo_questions > 0
                          else {"skipped": "--demo-questions 0"}),
        "stories_fidelity": (stories_fidelity(args.stories, args.stories_prompts) if args.stories != "none"
                             else {"skipped": "--stories none"}),
    }
    for n, v in result["workload_a"]["sizes"].items():
        print(f"\n{n} docs, {v['context_tokens']} tokens")
        for m, s in v["methods"].items():
            extra = f"  KL {s['mean_kl']:.4f} top-1 {s['top1_agree']:.0%}" if "mean_kl" in s else ""
            print(f"  {m:<15} TTFT {s['ttft_median_s'] * 1000:9.1f} ms  {speedup(s['speedup_vs_full'])}"
                  f"  reuse {s['reuse_ratio']:.0%}{extra}")
        print_flops(v["methods"])
        if "ours_cacheblend_vs_peer_cacheblend" in v:
            print(f"  peer TTFT / our cacheblend TTFT: {v['ours_cacheblend_vs_peer_cacheblend']:.2f}")
    peer = result["workload_a"]["peer"]
    print(f"\npeer: {peer}" if isinstance(peer, str) else f"\npeer {peer['method']}: "
          f"{peer.get('error', 'ran')}; chunk_size {peer['chunk_size']}, warm {peer.get('warm_s', 0):.2f} s")
    if "workload_b" in result:
        print("\nchat turn  prompt  ours ms  full ms  prefix-cache ms")
        for t in result["workload_b"]["turns"]:
            print(f"  {t['turn']:>7} {t['prompt_tokens']:>7} {t['ours_ttft_s'] * 1e3:8.1f} {t['full_ttft_s'] * 1e3:8.1f}"
                  f" {t['prefix_cache_ttft_s'] * 1e3:10.1f}")
    _print_quality(result["quality"])
    if args.json_path:
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).write_text(json.dumps(result, indent=2))
    if args.plot_path:
        plot(result, args.plot_path)
        plot_flops(result, str(Path(args.plot_path).with_name(Path(args.plot_path).stem + "_flops.png")))
    return 0


# re-exported: tests and benchmarks build their models from here
__all__ = ["DTYPES", "SHAPES", "ExactPrefixCache", "build_model", "full_prefill", "load_model", "main", "plot",
           "word_vocab", "workload_a", "workload_b"]


if __name__ == "__main__":
    raise SystemExit(main())
